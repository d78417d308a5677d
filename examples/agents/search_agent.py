"""A search agent (the ASearcher shape, at a size that runs on a CPU) written with the official `openai` SDK: a
`search` tool over a local corpus (a BM25 index, the `bm25s` library), questions that need one or two lookups,
and the answer in <answer>...</answer> graded by the reward service's `exact` verifier (the session's grading),
so the agent reports no reward itself.

    python examples/agents/search_agent.py --base-url http://127.0.0.1:8000 --episodes 16

The corpus and questions come from `search_corpus.py` (generated from `--world-seed`; nothing is downloaded).
"""

from __future__ import annotations

import functools
import random
import sys
from pathlib import Path

import bm25s
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
import search_corpus  # noqa: E402
from common import TaskSpec, arguments, chat_episode, play  # noqa: E402

SYSTEM = ("Answer questions about people and places using the search tool: it returns the encyclopedia entries "
          "that best match a query. Search as often as you need, then reply with <answer>NAME</answer>.")
TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the encyclopedia; returns the best-matching entries.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
TOP_K = 3
WORLD_SEED = 0


@functools.cache
def world() -> search_corpus.World:
    return search_corpus.build(WORLD_SEED)


@functools.cache
def index() -> bm25s.BM25:
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(world().documents, stopwords="en", show_progress=False), show_progress=False)
    return retriever


def search(query: str) -> str:
    docs = world().documents
    tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
    if not tokens.vocab:  # only stopwords: nothing to match
        return "no results"
    found, scores = index().retrieve(tokens, k=min(TOP_K, len(docs)), show_progress=False)
    hits = [docs[i] for i, s in zip(found[0], scores[0], strict=True) if s > 0]
    return "\n".join(f"[{n + 1}] {doc}" for n, doc in enumerate(hits)) or "no results"


def grading(answer: str) -> dict:
    return {"verifier": "exact", "answer": answer, "extract": "tag",
            "verifier_options": {"casefold": True, "strip_period": True}}


@functools.cache
def questions(held_out: bool = False) -> list[search_corpus.Question]:
    return [q for q in world().questions if q.held_out == held_out]


def question_task(rng: random.Random) -> tuple[str, str, dict]:
    """A training question (the held-out people's are never asked)."""
    q = rng.choice(questions())
    return q.id, q.text, grading(q.answer)


TASKS = {"questions": TaskSpec(question_task, SYSTEM, True, "one- and two-hop questions over the corpus", graded=True)}


def run_tool(name: str, args: dict | str) -> str:
    query = args.get("query") if isinstance(args, dict) else None
    if name != "search" or not isinstance(query, str) or not query:
        return f"error: call search with a 'query' string (got {name!r})"
    return search(query)


def episode(client: OpenAI, model: str, question: str, max_turns: int, max_tokens: int, *,
            system: str | None = SYSTEM, use_tools: bool = True,
            temperature: float | None = None) -> tuple[str, int, int]:
    """Returns (final answer text, model calls, tool calls)."""
    return chat_episode(client, model, question, max_turns, max_tokens, system=system,
                        tools=TOOLS if use_tools else None, run=run_tool,
                        temperature=temperature)


def main() -> None:
    global WORLD_SEED

    def extra(p) -> None:
        p.add_argument("--world-seed", type=int, default=0, help="the generated corpus and questions")

    args = arguments(__doc__, extra, tasks=TASKS)
    WORLD_SEED = args.world_seed
    base = args.base_url.rstrip("/")
    play(args, lambda key: OpenAI(base_url=base + "/v1", api_key=key, max_retries=5), episode, tasks=TASKS)


if __name__ == "__main__":
    main()
