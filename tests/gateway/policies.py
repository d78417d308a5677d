"""Policies for gateway tests: a tiny random Qwen3, and a scripted policy that replies deterministically.

The scripted policy is a torch module the EmbeddedEngine runs like any model (prefill, then one decode step
at a time); it reads the conversation so far and puts all probability on the next token of its reply, so
tests can drive tool calls through the real engine and the real gateway.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable

import torch

from services.rollout.engines.torch_engine import EmbeddedEngine
from services.trainer.models.tiny_qwen3 import TinyQwen3Config, build_tokenizer, padded_vocab_size

GEN_PROMPT = "<|im_start|>assistant\n"


class RecordingEngine(EmbeddedEngine):
    """An EmbeddedEngine that remembers every sequence it was given (the test's view of what was sampled)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.submitted: list = []

    def submit(self, prompt_ids, sampling, on_finish, *, priority=False):
        seq = super().submit(prompt_ids, sampling, on_finish)
        self.submitted.append(seq)
        return seq


def tokenizer():
    return build_tokenizer()


def random_engine(tok, *, seed: int = 0, max_context: int = 2048) -> RecordingEngine:
    torch.manual_seed(seed)
    cfg = TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, max_position_embeddings=4096)
    model = cfg.build(padded_vocab_size(tok), eos_token_id=tok.eos_token_id)
    return RecordingEngine(model.eval(), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           max_batch=64, max_context=max_context, seed=seed)


class ScriptedLM(torch.nn.Module):
    """next token = script(context); logits put (almost) all mass on it."""

    def __init__(self, vocab_size: int, script: Callable[[list[int]], int]) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.script = script
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self._rows: list[list[int]] = []

    def forward(self, input_ids, attention_mask=None, **_):
        if attention_mask is None or attention_mask.shape[1] == input_ids.shape[1]:  # prefill: whole contexts
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            self._rows = [row[m.bool()].tolist() for row, m in zip(input_ids, mask, strict=True)]
        else:  # decode: one new token per row
            for row, token in zip(self._rows, input_ids[:, -1].tolist(), strict=True):
                row.append(token)
        logits = torch.full((len(self._rows), 1, self.vocab_size), -30.0)
        for i, row in enumerate(self._rows):
            logits[i, 0, self.script(row)] = 0.0
        return types.SimpleNamespace(logits=logits)


def reply_script(tok, reply_for: Callable[[str, str], str]) -> Callable[[list[int]], int]:
    """Turns `reply_for(prompt_text, forced_text) -> reply text` into a next-token function (reply, then <|im_end|>).

    forced_text is what the gateway put after the generation prompt (a forced tool-call prefix); the reply
    continues it.
    """
    gen = tok.encode(GEN_PROMPT, add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replies: dict[tuple, list[list[int]]] = {}

    def next_token(context: list[int]) -> int:
        start = _last_index(context, gen)
        if start < 0:
            return end
        prompt, done = tuple(context[:start + len(gen)]), context[start + len(gen):]
        known = replies.setdefault(prompt, [])
        reply = next((r for r in known if r[:len(done)] == done), None)
        if reply is None:  # first step of this sequence: `done` is exactly the forced prefix
            text = reply_for(tok.decode(list(prompt)), tok.decode(done))
            reply = done + tok.encode(text, add_special_tokens=False) + [end]
            known.append(reply)
        return reply[len(done)] if len(done) < len(reply) else end

    return next_token


def scripted_engine(tok, reply_for: Callable[[str, str], str], *, max_context: int = 4096) -> RecordingEngine:
    model = ScriptedLM(padded_vocab_size(tok), reply_script(tok, reply_for))
    return RecordingEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch=64,
                           max_context=max_context, seed=0)


def calculator_replies(prompt: str, forced: str = "") -> str:
    """A well-behaved tool-using policy: calls the tool named in the prompt, then answers with its result.

    Its tool calls use compact JSON and stray whitespace, which the chat template would render differently,
    so a gateway that re-tokenised the history would not reproduce the sampled tokens.
    """
    turns = prompt.split("<|im_start|>")
    last = turns[-2] if len(turns) >= 2 else ""
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last, flags=re.S)
    if forced:  # tool_choice required / named: continue the gateway's prefix with a call
        name, args = ("get_weather", '"location": "San Francisco"') if "get_weather" in prompt else \
            ("calculator", '"expression": "1+2"')
        tail = args + "}}\n</tool_call>"
        return (name + '", "arguments": {' + tail) if forced.endswith('"') else "{" + tail
    if "get_weather" in prompt and not results:
        call = '{"name":"get_weather","arguments":{"location":"San Francisco"}}'
    elif re.search(r'"calculator"|\bcalculator\(', prompt) and prompt.count("<tool_response>") < 4 and (not results or results[-1].strip().isdigit()):
        n = prompt.count("<tool_response>")
        call = f'{{"name":"calculator","arguments":{{"expression":"{n + 1}+{n + 2}"}}}}'
    elif results:
        return f"The answer is {results[-1].strip()}."
    else:
        return "Hello there, friend!"
    return f"Let me check.  \n<tool_call>\n{call}\n</tool_call>"


def arithmetic_replies(prompt: str, forced: str = "") -> str:
    """The example agents' task solved properly: one calculator call, then 'Answer: <result>'."""
    question = re.findall(r"What is (.+?)\?", prompt)
    results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, flags=re.S)
    if results:
        return f"Answer: {results[-1].strip()}"
    expression = question[-1] if question else "1+1"
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


def _last_index(seq: list[int], sub: list[int]) -> int:
    for i in range(len(seq) - len(sub), -1, -1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


def demonstration_steps(agent, tasks) -> Callable[[str], object]:
    """The step of a demonstrated episode (scripts/tool_episodes.py's `agent.steps`) that a prompt has reached: its
    task found by the question in the prompt, the step after as many tool results as the prompt holds. `tasks`:
    (question, expected) pairs."""
    episodes = {question: agent.steps(question, expected) for question, expected in tasks}

    def step(prompt: str):
        question = next(q for q in episodes if f"user\n{q}<|im_end|>" in prompt)
        return episodes[question][prompt.count("<tool_response>")]
    return step
