"""Verifiers run with a deadline off the event loop: a verification past it scores 0 with the reason, its worker
is replaced, and bad trajectories are InvalidMessages before any verifier runs."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.common import grading
from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.reward.scoring import Scorer
from services.reward.verifiers.pool import VerifierPool


@pytest.fixture(scope="module")
def pool():
    pool = VerifierPool(workers=1)
    yield pool
    pool.close()


def traj(**kw) -> data_pb2.Trajectory:
    base = dict(trajectory_id="t-1", group_id="g", completion_ids=[52, 50], versions=[0, 0], behavior_logprobs=[-1.0, -2.0],
                loss_mask=[1, 1], grading=grading.to_proto({"answer": "42", "extract": "last_number"}))
    base.update(kw)
    return data_pb2.Trajectory(**base)


def symbolic_traj(**kw) -> data_pb2.Trajectory:
    """Needs math-verify (0.5 against 1/2): scored in a worker, not by the verifier's in-process quick check."""
    return traj(completion_ids=[ord(c) for c in "0.5"], versions=[0] * 3, behavior_logprobs=[-1.0] * 3,
                loss_mask=[1] * 3, grading=grading.to_proto({"answer": "1/2", "extract": "last_number"}), **kw)


def test_a_verification_past_its_deadline_scores_zero_and_the_worker_is_replaced(pool):
    slow = Scorer(lambda ids: "".join(map(chr, ids)), "math", timeout_s=1e-4, pool=pool)
    verdict = slow.score_text("math", "\\frac{1}{2} + \\sqrt{2}", {"answer": "0.5 + 2^{1/2}", "extract": "all"})
    assert verdict.reward == 0.0 and verdict.detail.startswith("timeout")
    assert pool.timeouts >= 1
    fine = Scorer(lambda ids: "".join(map(chr, ids)), "math", timeout_s=30, pool=pool)
    assert fine.score(symbolic_traj()).reward == 1.0  # a fresh worker took over


async def test_scoring_keeps_the_event_loop_free(pool):
    scorer = Scorer(lambda ids: "".join(map(chr, ids)), "math", timeout_s=30, pool=pool)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    scored = await asyncio.gather(*(scorer.score_async(symbolic_traj(trajectory_id=f"t-{i}")) for i in range(4)))
    task.cancel()
    assert [s.reward for s in scored] == [1.0] * 4 and ticks > 0


@pytest.mark.parametrize("bad, field", [
    ({"completion_ids": [-5, 1]}, "completion_ids"), ({"prompt_ids": [1, 10**6]}, "prompt_ids"),
    ({"behavior_logprobs": [math.nan, 0.0]}, "behavior_logprobs"), ({"loss_mask": [1, 7]}, "loss_mask"),
    ({"versions": [0, -9]}, "versions"), ({"trajectory_id": "a b"}, "trajectory_id"),
    ({"grading": grading.to_proto({"answer": "1", "extract": "nope"})}, "grading.extract"),
])
def test_bad_trajectories_are_refused_before_any_verifier_runs(pool, bad, field):
    scorer = Scorer(lambda ids: "".join(map(chr, ids)), "math", vocab_size=1000, pool=pool)
    with pytest.raises(InvalidMessage, match=field):
        scorer.score(traj(**bad))


def test_a_tokenizer_that_cannot_decode_the_ids_makes_an_invalid_message(pool):
    def decode(ids):
        raise OverflowError("out of range")

    with pytest.raises(InvalidMessage, match="completion_ids"):
        Scorer(decode, "math", pool=pool).score(traj())


def test_reasoning_gym_scorers_run_in_the_workers(pool):
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", seed=5, size=1)[0]
    meta = {"answer": entry["answer"], "verifier": "reasoning_gym:basic_arithmetic", "rg_entry": entry}
    text = f"It is {entry['answer']}"
    scorer = Scorer(lambda ids: text, "math", timeout_s=30, pool=pool)
    right = scorer.score(traj(grading=grading.to_proto({**meta, "extract": "last_number"})))
    assert right.reward == 1.0 and right.verifier == "reasoning_gym:basic_arithmetic"
    assert scorer.score(traj(grading=grading.to_proto(meta))).reward < 1.0  # extract "all": the whole sentence
    with pytest.raises(InvalidMessage, match="grading.rg_entry: missing"):
        scorer.score(traj(grading=grading.to_proto({**meta, "rg_entry": None})))


class CountingPool(VerifierPool):
    def __init__(self) -> None:
        super().__init__(workers=1)
        self.calls = 0

    def score(self, *args, **kwargs):
        self.calls += 1
        return super().score(*args, **kwargs)


@pytest.mark.parametrize("gold, completion", [("42", "so 40 + 2 = 42"), ("7", "007"), ("-0", "0"),
                                              ("-13", "13"), ("100000000000000000001", "100000000000000000000"),
                                              ("5", "no number here")])
def test_integer_answers_are_scored_in_process_as_math_verify_scores_them(gold, completion):
    import math_verify

    from services.reward.verifiers.base import extract

    pool = CountingPool()
    try:
        verdict = Scorer(str, "math", timeout_s=30, pool=pool).score_text(
            "math", completion, {"answer": gold, "extract": "last_number"})
        assert pool.calls == 0
    finally:
        pool.close()
    answer = extract(completion, "last_number")
    expected = answer is not None and math_verify.verify(math_verify.parse(gold), math_verify.parse(answer),
                                                          timeout_seconds=None)
    assert verdict.reward == float(expected)


@pytest.mark.parametrize("gold, completion, reward", [("1/2", "0.5", 1.0), ("12", "12.0", 1.0), ("+5", "5", 0.0),
                                                      ("0.25", "1/4", 1.0)])
def test_anything_but_two_integers_goes_to_a_worker(gold, completion, reward):
    pool = CountingPool()
    try:
        verdict = Scorer(str, "math", timeout_s=30, pool=pool).score_text(
            "math", completion, {"answer": gold, "extract": "all"})
        assert pool.calls == 1 and verdict.reward == reward
    finally:
        pool.close()


async def test_score_async_settles_quick_verdicts_on_the_loop_and_the_rest_on_a_worker_thread(pool, monkeypatch):
    hops = 0
    to_thread = asyncio.to_thread

    async def counting_to_thread(fn, *args, **kwargs):
        nonlocal hops
        hops += 1
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr("services.reward.scoring.asyncio.to_thread", counting_to_thread)
    scorer = Scorer(lambda ids: "".join(map(chr, ids)), "math", timeout_s=30, pool=pool)
    plain = await scorer.score_async(traj(trajectory_id="plain", completion_ids=[ord(c) for c in "so 42"],
                                          versions=[0] * 5, behavior_logprobs=[-1.0] * 5, loss_mask=[1] * 5))
    wrong = await scorer.score_async(traj(trajectory_id="wrong", completion_ids=[ord(c) for c in "41"]))
    assert hops == 0  # both settled on the loop
    symbolic = await scorer.score_async(symbolic_traj(trajectory_id="symbolic"))
    assert hops == 1  # math-verify: one hop to a scorer thread
    assert (plain.reward, wrong.reward, symbolic.reward) == (1.0, 0.0, 1.0)
    assert plain.scored and plain.verifier == "math" and plain.trajectory_id == "plain"
    assert symbolic.scored and symbolic.trajectory_id == "symbolic"
    with pytest.raises(InvalidMessage, match="loss_mask"):  # refused on the loop too
        await scorer.score_async(traj(loss_mask=[1, 7]))
    assert hops == 1
