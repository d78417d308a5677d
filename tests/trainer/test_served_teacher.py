"""A served teacher for on-policy distillation: the frozen model's server scores token ids (OpenAI legacy completions
with echo, as vLLM answers it) on its engine's thread; the trainer's ServedReference reads every row's log-probs
from it, equal to the same model loaded in the trainer; a teacher whose tokenizer reads text differently is refused
at start naming reference.served; bad scoring requests are 400s naming the field."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.hf_models import load_lm
from services.rollout.engines import runner
from services.rollout.engines.torch_engine import EngineConfig
from services.trainer.batching import pack
from services.trainer.reference import Reference, ReferenceConfig
from services.trainer.served_reference import ServedReference
from tests.gateway.harness import ADMIN, GatewayServer

DEADLINE = 120.0


@pytest.fixture
def teacher(tiny_qwen3):
    engine = EngineConfig(model_path=str(tiny_qwen3), max_batch=8).build()
    server = GatewayServer(engine, AutoTokenizer.from_pretrained(tiny_qwen3), sessions_enabled=False).start()
    yield server
    server.stop()


def rows(n: int) -> list[data_pb2.Trajectory]:
    out = []
    for i in range(n):
        completion = [ord(c) for c in str(2 * i)] + [256]
        out.append(data_pb2.Trajectory(
            trajectory_id=f"t{i}", group_id=f"g{i // 2}", prompt_ids=[ord(c) for c in f"{i}+{i}="],
            completion_ids=completion, behavior_logprobs=[-1.0] * len(completion), versions=[0] * len(completion),
            loss_mask=[1] * len(completion), reward=1.0))
    return out


def test_the_served_teachers_log_probs_are_the_loaded_ones(teacher, tiny_qwen3):
    batch = pack(rows(7), pad_token_id=256)  # rows of several lengths
    served = ServedReference(teacher.url + "/v1", ADMIN, rows_per_call=4)  # two calls for the batch
    served.check_tokenizer(AutoTokenizer.from_pretrained(tiny_qwen3))
    local = Reference(load_lm(tiny_qwen3, torch.float32).eval())
    real = batch.attention_mask[:, 1:].bool()
    for temperature in (1.0, 0.7):
        torch.testing.assert_close(served.logp(batch, temperature)[real], local.logp(batch, temperature)[real],
                                   atol=2e-5, rtol=0)
    assert served.calls == 5 + 2 * 2  # the tokenizer probes, then two calls a batch
    for temperature in (1.0, 0.7):   # with the top-k of distill_topk, over HTTP with token-id keys
        (their_logp, theirs), (my_logp, mine) = (r.logp_and_top(batch, temperature, 5) for r in (served, local))
        torch.testing.assert_close(their_logp[real], my_logp[real], atol=2e-5, rtol=0)
        torch.testing.assert_close(their_logp[real], local.logp(batch, temperature)[real], atol=2e-5, rtol=0)
        assert torch.equal(theirs.ids[real], mine.ids[real])
        torch.testing.assert_close(theirs.logp[real], mine.logp[real], atol=2e-5, rtol=0)
    assert served.calls == 5 + 2 * 2 + 2 * 2  # the same two calls a batch with the top-k


def test_a_teacher_reading_text_differently_is_refused(teacher, vlm_tokenizer):
    with pytest.raises(FieldError, match="reference.served: the served teacher's tokenizer reads"):
        ServedReference(teacher.url + "/v1", ADMIN).check_tokenizer(vlm_tokenizer)


def test_scoring_requests_are_checked_naming_the_field(teacher):
    def post(body: dict) -> httpx.Response:
        return httpx.post(teacher.url + "/v1/completions", json={"model": "m", "echo": True, "logprobs": 0,
                                                                 "max_tokens": 0, **body},
                          headers={"Authorization": f"Bearer {ADMIN}"}, timeout=DEADLINE)

    ok = post({"prompt": [[65, 66, 67], [68, 69]]}).json()
    assert [c["logprobs"]["token_logprobs"][0] for c in ok["choices"]] == [None, None]
    assert [len(c["logprobs"]["token_logprobs"]) for c in ok["choices"]] == [3, 2]
    assert [c["logprobs"]["top_logprobs"] for c in ok["choices"]] == [None, None]
    assert ok["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    top = post({"prompt": [65, 66, 67], "logprobs": 3}).json()["choices"][0]["logprobs"]
    assert top["tokens"] == ["A", "B", "C"] and top["top_logprobs"][0] is None
    assert [len(d) for d in top["top_logprobs"][1:]] == [3, 3]
    assert all(max(d.values()) >= lp for d, lp in zip(top["top_logprobs"][1:], top["token_logprobs"][1:], strict=True))
    keyed = post({"prompt": [65, 66, 67], "logprobs": 3, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert keyed["logprobs"]["tokens"] == ["token_id:65", "token_id:66", "token_id:67"] and keyed["text"] == "ABC"
    assert all(k.startswith("token_id:") for d in keyed["logprobs"]["top_logprobs"][1:] for k in d)
    for body, field in (({"prompt": [65, 66], "max_tokens": 1}, "max_tokens"),
                        ({"prompt": [65, 66], "logprobs": 21}, "logprobs"),
                        ({"prompt": [65, 66], "return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
                        ({"prompt": [[65], [10 ** 6]]}, "prompt[1]"),
                        ({"prompt": "text"}, "prompt"),
                        ({"prompt": [65, 66], "stream": True}, "stream")):
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)


def test_a_served_reference_needs_its_url():
    with pytest.raises(FieldError, match="reference.url: unset for the served reference 'teacher'"):
        ReferenceConfig(served="teacher").build(torch.nn.Linear(1, 1), "unused")
    with pytest.raises(FieldError, match="reference.model_path"):
        ReferenceConfig(url="http://127.0.0.1:1/v1", model_path="x")


def test_the_engine_scores_between_steps_and_refuses_once_stopped(tiny_qwen3, monkeypatch):
    engine = EngineConfig(model_path=str(tiny_qwen3), max_batch=4).build()
    model = load_lm(tiny_qwen3, torch.float32).eval()
    engine.start()
    try:
        texts = ["12+30=42", "7+1=8", "99+99=198"]
        contexts = [[ord(c) for c in t] for t in texts]
        whole = asyncio.run(asyncio.wait_for(engine.score(contexts), DEADLINE))
        monkeypatch.setattr(runner, "SCORE_TOKENS", 12)  # a forward per row or two
        chunked = asyncio.run(asyncio.wait_for(engine.score(contexts), DEADLINE))
        assert [len(c.logprobs) for c in chunked] == [len(c) - 1 for c in contexts]
        assert sum((c.logprobs for c in chunked), []) == pytest.approx(sum((c.logprobs for c in whole), []), abs=2e-5)
        for ids, (scored, *_) in zip(contexts, whole, strict=True):
            with torch.no_grad():
                own = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
            torch.testing.assert_close(torch.tensor(scored), own.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0],
                                       atol=2e-5, rtol=0)
    finally:
        engine.stop()
    ids = contexts[0]
    with pytest.raises(RuntimeError, match="engine stopped"):
        asyncio.run(asyncio.wait_for(engine.score([ids]), DEADLINE))
