"""Verifiers and trajectory scoring."""

from __future__ import annotations

import pytest

from services.common import grading
from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.reward.scoring import Scorer
from services.reward.verifiers import Verdict, build_verifier, registry
from services.reward.verifiers.judge import JudgeConfig, JudgeVerifier


@pytest.mark.parametrize("response,reward", [("47", 1.0), ("the sum is 47", 1.0), ("46", 0.0), ("4 7", 0.0),
                                             ("", 0.0), ("47.0", 1.0), ("-47", 0.0)])
def test_math_verifier_grades_the_last_number(response, reward):
    verdict = build_verifier("math").score(response, {"answer": "47", "extract": "last_number"})
    assert verdict.reward == reward


def test_math_verifier_handles_symbolic_answers_and_tags():
    v = build_verifier("math")
    assert v.score("<answer>1/2</answer>", {"answer": "0.5", "extract": "tag"}).reward == 1.0
    assert v.score("<answer>\\frac{2}{4}</answer>", {"answer": "1/2", "extract": "tag"}).reward == 1.0
    assert v.score("no tag 0.5", {"answer": "0.5", "extract": "tag"}).reward == 0.0


def test_exact_verifier_and_errors_name_the_field():
    assert build_verifier("exact").score(" yes ", {"answer": "yes"}).reward == 1.0
    with pytest.raises(ValueError, match="verifier"):
        build_verifier("nope")
    with pytest.raises(ValueError, match="grading.answer"):
        build_verifier("math").score("1", {})
    with pytest.raises(ValueError, match="grading.extract"):
        build_verifier("math").score("1", {"answer": "1", "extract": "first_word"})


def _traj(completion: list[int], meta: dict | data_pb2.Grading, n: int | None = None) -> data_pb2.Trajectory:
    n = len(completion) if n is None else n
    return data_pb2.Trajectory(trajectory_id="t", group_id="g", completion_ids=completion, versions=[0] * n,
                               behavior_logprobs=[0.0] * n, loss_mask=[1] * n,
                               grading=meta if isinstance(meta, data_pb2.Grading) else grading.to_proto(meta))


def test_scorer_decodes_scores_and_keeps_everything_else():
    scorer = Scorer(lambda ids: "".join(chr(i) for i in ids), "math")
    traj = _traj([ord("4"), ord("2")], {"answer": "42", "extract": "last_number"})
    scored = scorer.score(traj)
    assert scored.scored and scored.reward == 1.0 and scored.verifier == "math"
    assert list(scored.completion_ids) == list(traj.completion_ids) and scored.trajectory_id == "t"
    assert scorer.score(_traj([ord("7")], {"answer": "42", "extract": "last_number"})).reward == 0.0


@pytest.mark.parametrize("traj,field", [
    (_traj([1, 2], {"answer": "1"}, n=1), "behavior_logprobs"),
    (_traj([1], data_pb2.Grading(verifier_options=b"\xc1not msgpack")), "grading.verifier_options: not msgpack"),
    (_traj([1], data_pb2.Grading(answer="1", row=b"\x91\x01")), "grading.row: must be a msgpack map"),
    (_traj([1], {"verifier": "math"}), "grading.answer"),
    (_traj([1], {"answer": "1", "verifier": "unknown"}), "verifier"),
])
def test_bad_trajectories_are_invalid_messages_naming_the_field(traj, field):
    scorer = Scorer(lambda ids: "1", "math")
    with pytest.raises(InvalidMessage, match=field):
        scorer.score(traj)


def test_the_verifier_comes_from_grading_then_the_trajectory_then_the_default():
    scorer = Scorer(lambda ids: "Yes", "math")
    traj = _traj([1], {"answer": "yes", "verifier": "exact", "verifier_options": {"casefold": True}})
    assert scorer.score(traj).reward == 1.0 and scorer.score(traj).verifier == "exact"
    traj = _traj([1], {"answer": "yes", "verifier_options": {"casefold": True}})
    traj.verifier = "exact"
    assert scorer.score(traj).verifier == "exact"
    with pytest.raises(InvalidMessage, match="grading.verifier: unknown 'exactly'"):
        scorer.score(_traj([1], {"answer": "yes", "verifier": "exactly"}))
    traj.verifier = "exactly"
    with pytest.raises(InvalidMessage, match="^verifier: unknown 'exactly'"):
        scorer.score(traj)


def test_the_pool_config_names_the_bad_key():
    from services.common.config import ConfigError, load_config
    from services.reward.config import RewardConfig

    env = {"MESHRL_REWARD__VERIFIER_POOL__WORKERS": "3"}
    assert load_config(RewardConfig, "reward", env=env).verifier_pool.workers == 3
    with pytest.raises(ConfigError, match="reward.verifier_pool.timeout_s: must be > 0"):
        load_config(RewardConfig, "reward", env={"MESHRL_REWARD__VERIFIER_POOL__TIMEOUT_S": "0"})


class _Fixed:
    """A verifier that answers `grading.reward` whatever the response: a buggy or forged verdict."""

    name, isolated = "fixed", False

    def check(self, task):
        pass

    def score(self, response, task):
        return Verdict(task["reward"], "as told")


class _Signed(_Fixed):
    reward_range = (-1.0, 1.0)


@pytest.mark.parametrize("cls,reward,clamped", [
    (_Fixed, 50.0, 1.0), (_Fixed, -3.0, 0.0), (_Fixed, float("nan"), 0.0), (_Fixed, float("inf"), 1.0),
    (_Fixed, 0.25, 0.25), (_Signed, -0.5, -0.5), (_Signed, -7.0, -1.0)])
def test_every_verdict_is_clamped_to_the_verifiers_range(monkeypatch, cls, reward, clamped):
    monkeypatch.setitem(registry.BUILTIN, "fixed", cls)
    scorer = Scorer(lambda ids: "".join(map(chr, ids)), "fixed")
    verdict = scorer.score_text("fixed", "x", {"reward": reward})
    assert verdict.reward == clamped and (verdict.reward == reward) != ("clamped to" in verdict.detail)
    traj = scorer.score(_traj([ord("x")], {"reward": reward}))
    assert traj.reward == clamped
    shaped = scorer.score_text("fixed", "<answer>x</answer>", {"reward": reward, "shaping": [{"name": "format"}]})
    assert shaped.reward == pytest.approx(clamped + 0.1)  # shaping comes after the clamp, unclipped by design


def test_the_judges_range_takes_in_its_failure_reward():
    assert JudgeVerifier(JudgeConfig()).reward_range == (0.0, 1.0)
    assert JudgeVerifier(JudgeConfig(failure_reward=-1.0)).reward_range == (-1.0, 1.0)


def test_a_group_is_scored_together_and_a_member_that_cannot_be_names_itself():
    import asyncio

    scorer = Scorer(lambda ids: "".join(chr(i) for i in ids), "math")
    members = []
    for k, text in enumerate(["42", "41", "so 42"]):
        t = _traj([ord(c) for c in text], {"answer": "42", "extract": "last_number"})
        t.trajectory_id = f"t-{k}"
        members.append(t)
    scored = asyncio.run(scorer.score_group_async(members))
    assert [(t.trajectory_id, t.reward, t.scored) for t in scored] == [("t-0", 1.0, True), ("t-1", 0.0, True),
                                                                         ("t-2", 1.0, True)]
    members[1].behavior_logprobs.append(0.0)  # one more log-prob than tokens: never scorable
    with pytest.raises(InvalidMessage, match="trajectory 't-1': behavior_logprobs"):
        asyncio.run(scorer.score_group_async(members))
