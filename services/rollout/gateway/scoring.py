"""Scoring token ids with the served model (OpenAI legacy completions with ``echo: true, max_tokens: 0``): the
log-prob of each prompt token given the ones before it, as vLLM's server answers ``echo`` + ``logprobs``. A frozen
teacher serves the trainer's on-policy distillation this way: a batch of sampled sequences per call.
``logprobs: k`` (at most MAX_TOP) adds each position's k likeliest tokens in ``top_logprobs``, keyed by their text,
or by ``token_id:<id>`` with ``return_tokens_as_token_ids: true`` (vLLM's extension; texts can collide)."""

from __future__ import annotations

import dataclasses

from services.rollout.gateway import fields as f
from services.rollout.gateway.errors import bad_request, unsupported

MAX_PROMPTS = 1024  # sequences scored in one call
MAX_TOP = 20  # likeliest tokens per position (vLLM's default max_logprobs)


@dataclasses.dataclass
class ScoreRequest:
    model: str
    prompts: list[list[int]]
    temperature: float
    top: int = 0
    ids_as_keys: bool = False


def is_scoring(body: dict) -> bool:
    return isinstance(body, dict) and body.get("echo") is True


def parse_score(body: dict, vocab_size: int | None) -> ScoreRequest:
    """A completions body with echo true: only max_tokens 0, logprobs 0 to MAX_TOP and token-id prompts (one, or a
    batch)."""
    if f.integer(body, "max_tokens", default=None, lo=0) != 0:
        raise unsupported("max_tokens", "with echo, only 0 is supported (score the prompt, generate nothing)")
    top = f.integer(body, "logprobs", default=None, lo=0)
    if top is None or top > MAX_TOP:
        raise unsupported("logprobs", f"with echo, set 0 (the prompt tokens' own log-probs) to {MAX_TOP} (and each "
                          "position's likeliest tokens)")
    ids_as_keys = body.get("return_tokens_as_token_ids", False)
    if not isinstance(ids_as_keys, bool):
        raise bad_request("return_tokens_as_token_ids", "expected true or false")
    allowed = {"stream": (None, False), "n": (None, 1), "best_of": (None, 1), "suffix": (None, ""), "stop": (None, [])}
    for key, values in allowed.items():
        if not any(body.get(key) == v and type(body.get(key)) is type(v) for v in values):
            raise unsupported(key, "not supported with echo")
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt) else [prompt]
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise bad_request("prompt", f"1 to {MAX_PROMPTS} sequences per call, got {len(prompts)}")
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 and prompt is ids else f"prompt[{i}]"
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise bad_request(where, "with echo, expected token ids (a non-empty array of integers >= 0)")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise bad_request(where, f"token id {max(ids)} is outside the vocabulary [0, {vocab_size})")
    temperature = f.number(body, "temperature", default=1.0, lo=0.0, hi=2.0, lo_open=True)
    return ScoreRequest(model=f.string(body, "model", default=""), prompts=prompts, temperature=temperature, top=top,
                        ids_as_keys=ids_as_keys)


def score_response(req: ScoreRequest, scored: list, created: int, completion_id: str, token_text) -> dict:
    """OpenAI's legacy completion object: one choice per prompt, its text the prompt's, token_logprobs from the
    second token on (the first has none: None), and with ``logprobs: k`` the k likeliest tokens at each position.
    ``scored``: the engine's ``Scored`` per prompt."""
    def key(token: int) -> str:
        return f"token_id:{token}" if req.ids_as_keys else token_text(token)

    choices = []
    for i, (ids, one) in enumerate(zip(req.prompts, scored, strict=True)):
        texts = [token_text(t) for t in ids]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        top = None
        if req.top:
            top = [None, *({key(t): lp for t, lp in zip(tids, lps, strict=True)}
                           for tids, lps in zip(one.top_ids, one.top_logprobs, strict=True))]
        choices.append({"index": i, "text": "".join(texts), "finish_reason": "length",
                        "logprobs": {"tokens": [key(t) for t in ids], "token_logprobs": [None, *one.logprobs],
                                     "top_logprobs": top, "text_offset": offsets}})
    total = sum(len(p) for p in req.prompts)
    return {"id": completion_id, "object": "text_completion", "created": created, "model": req.model, "choices": choices,
            "usage": {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total}}
