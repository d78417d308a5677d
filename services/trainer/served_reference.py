"""A reference policy served elsewhere (a frozen teacher for on-policy distillation): the trainer sends each batch's
rows as token ids to an OpenAI-compatible server (`services.rollout.frozen`, or vLLM) and reads back every token's
log-prob (legacy completions with ``echo: true``, ``max_tokens: 0``, ``logprobs: 0``), in calls of at most
``rows_per_call`` rows. The teacher's weights never live in the trainer's process.

At start the server's tokenizer is checked against the policy's (its ``/tokenize`` on probe texts): distillation
compares the two models' log-probs of the same token ids."""

from __future__ import annotations

import time

import httpx
import torch

from services.common.errors import FieldError
from services.trainer.batching import PackedBatch
from services.trainer.forward import TeacherTopK

PROBES = ("The answer is 42.\n", "<|im_start|>user\n2 + 2 = ?<|im_end|>\n", " caf\u00e9 \u4e16\u754c \U0001f600", "x = f(y) // 3;")


class ServedReference:
    def __init__(self, url: str, key: str, *, timeout_s: float = 120.0, rows_per_call: int = 256,
                 wait_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.rows_per_call = rows_per_call
        self.wait_s = wait_s  # the server may still be loading its model when the first batch comes
        self.client = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=timeout_s)
        self.calls = 0

    def check_tokenizer(self, tokenizer) -> None:
        """FieldError naming reference.served unless the server reads the probe texts as the policy does."""
        root = self.url[:-3] if self.url.endswith("/v1") else self.url
        specials = "".join(getattr(tokenizer, "all_special_tokens", []) or [])
        for text in (*PROBES, specials) if specials else PROBES:
            theirs = self._post(f"{root}/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
            mine = tokenizer.encode(text, add_special_tokens=False)
            if list(theirs) != list(mine):
                raise FieldError("reference.served", f"the served teacher's tokenizer reads {text!r} as {theirs[:12]}, "
                                 f"the policy's as {mine[:12]}: distillation needs one tokenizer")

    def logp(self, batch: PackedBatch, temperature: float) -> torch.Tensor:
        """Per-token log-probs under the served model, float[B, L-1] (position t: token t + 1), 0 past each row."""
        out = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
        for row, choice in self._scored(batch, temperature, 0):
            scored = choice["logprobs"]["token_logprobs"][1:]  # the first token has none
            out[row, :len(scored)] = torch.tensor(scored, dtype=torch.float32)
        return out.to(batch.input_ids.device)

    def _scored(self, batch: PackedBatch, temperature: float, top: int):
        """(row, its choice) for every row of ``batch``, in calls of at most rows_per_call rows."""
        if batch.pixel_values is not None:
            raise ValueError("reference.served: a served teacher scores token ids only; this batch has images")
        lengths = batch.attention_mask.sum(-1).tolist()
        rows = [ids[:n] for ids, n in zip(batch.input_ids.tolist(), lengths, strict=True)]
        for start in range(0, len(rows), self.rows_per_call):
            chunk = rows[start:start + self.rows_per_call]
            body = {"model": "teacher", "prompt": chunk, "echo": True, "max_tokens": 0, "logprobs": top,
                    "temperature": temperature, **({"return_tokens_as_token_ids": True} if top else {})}
            choices = sorted(self._post(f"{self.url}/completions", body)["choices"], key=lambda c: c["index"])
            for i, choice in enumerate(choices):
                if len(choice["logprobs"]["token_logprobs"]) != len(chunk[i]):
                    raise RuntimeError(f"reference.served: {len(choice['logprobs']['token_logprobs']) - 1} "
                                       f"log-probs for a {len(chunk[i])}-token row")
                yield start + i, choice

    def logp_and_top(self, batch: PackedBatch, temperature: float, k: int) -> tuple[torch.Tensor, TeacherTopK]:
        """``logp`` and the served model's k likeliest next tokens at every position, long/float[B, L-1, k] (ids 0
        and log-probs 0 past each row), from the same calls (``logprobs: k`` with token-id keys, as vLLM answers
        ``return_tokens_as_token_ids``)."""
        taken = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
        ids = torch.zeros(*taken.shape, k, dtype=torch.long)
        logp = torch.zeros(ids.shape)
        for row, choice in self._scored(batch, temperature, k):
            scored = choice["logprobs"]["token_logprobs"][1:]
            taken[row, :len(scored)] = torch.tensor(scored, dtype=torch.float32)
            for t, top in enumerate(choice["logprobs"]["top_logprobs"][1:]):
                best = sorted(top.items(), key=lambda item: -item[1])[:k]  # vLLM adds the scored token: k + 1
                if len(best) < k:
                    raise RuntimeError(f"reference.served: {len(best)} top log-probs at a position, {k} asked for")
                ids[row, t] = torch.tensor([int(key.removeprefix("token_id:")) for key, _ in best])
                logp[row, t] = torch.tensor([value for _, value in best])
        device = batch.input_ids.device
        return taken.to(device), TeacherTopK(ids.to(device), logp.to(device))

    def _post(self, url: str, body: dict) -> dict:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                response = self.client.post(url, json=body)
            except httpx.TransportError as exc:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"reference.served: {url} did not answer within {self.wait_s:.0f} s ({exc})") from exc
                time.sleep(1.0)
                continue
            if response.status_code != 200:
                raise RuntimeError(f"reference.served: {url} answered {response.status_code}: {response.text[:300]}")
            self.calls += 1
            return response.json()
