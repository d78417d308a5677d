"""Verifiers that score steps: `arithmetic_chain` rewards each worked line, the reward service places every step on
the completion token that ends it (with the run's real tokenizer), through the worker pool too, and the trainer's
process presets train on those step rewards as they do on an agent's."""

from __future__ import annotations

import pytest
import torch

from services.common import grading
from services.common.contracts import data_pb2
from services.common.steps import check_step_rewards
from services.reward.scoring import Scorer
from services.reward.verifiers import Verdict, build_verifier
from services.reward.verifiers.arithmetic_chain import evaluate
from services.reward.verifiers.base import StepVerdict, clamp
from services.reward.verifiers.pool import VerifierPool
from services.trainer.algorithms import AlgorithmConfig
from services.trainer.batching import pack

WORKED = "First, 3 + 4 = 7.\nThen 7 * 2 = 15\nSo (7 * 2) - 1 = 13\nThe answer is 13"


def test_each_worked_line_is_a_step_and_the_final_answer_the_last():
    verdict = build_verifier("arithmetic_chain").score(WORKED, {"answer": "13"})
    assert verdict.reward == 1.0 and "2/3 steps right" in verdict.detail
    lines = WORKED.split("\n")
    ends = [len(lines[0]), len(lines[0]) + 1 + len(lines[1]), len("\n".join(lines[:3])), len(WORKED)]
    assert verdict.steps == tuple(StepVerdict(e, r) for e, r in zip(ends, [1.0, 0.0, 1.0, 1.0], strict=True))
    wrong = build_verifier("arithmetic_chain").score("2 + 2 = 4\nso 5", {"answer": "4"})
    assert wrong.reward == 0.0 and [s.reward for s in wrong.steps] == [1.0, 0.0]
    assert build_verifier("arithmetic_chain").score("no work", {"answer": "1"}).steps == (StepVerdict(7, 0.0),)


@pytest.mark.parametrize("expression, value", [
    ("3 + 4 * 2", 11.0), ("(1 + 2) / 4", 0.75), ("-3 - -3", 0.0), ("2 ** 4", None), ("1 / 0", None),
    ("__import__('os')", None), ("9" * 20, None), ("1 +", None), ("(" * 150 + "1" + ")" * 150, None)])
def test_only_plain_arithmetic_is_evaluated(expression, value):
    assert evaluate(expression) == value


def test_steps_are_clamped_with_the_outcome():
    verdict = clamp(Verdict(2.0, "d", (StepVerdict(3, -1.0), StepVerdict(5, 0.5))), (0.0, 1.0))
    assert verdict.reward == 1.0 and [s.reward for s in verdict.steps] == [0.0, 0.5]


@pytest.fixture(scope="module")
def tokenizer():
    from services.trainer.models import build_tokenizer

    return build_tokenizer()


def scored(tokenizer, text: str, mask: list[int] | None = None, prefix: list[int] = (), **extra):
    ids = [*prefix, *tokenizer.encode(text, add_special_tokens=False)]
    mask = mask if mask is not None else [1] * len(ids)
    traj = data_pb2.Trajectory(trajectory_id="t", group_id="g", completion_ids=ids, versions=[0] * len(ids),
                               behavior_logprobs=[0.0] * len(ids), loss_mask=mask,
                               grading=grading.to_proto({"answer": "13", "verifier": "arithmetic_chain", **extra}))
    scorer = Scorer(lambda t: tokenizer.decode(t, skip_special_tokens=True), "math")
    return scorer.score(traj), ids


def test_the_reward_service_places_each_step_on_the_token_that_ends_it(tokenizer):
    out, ids = scored(tokenizer, WORKED)
    check_step_rewards(out)         # what the builder and the trainer check
    assert out.reward == 1.0 and [s.reward for s in out.step_rewards] == [1.0, 0.0, 1.0, 1.0]
    lines = WORKED.split("\n")
    for step, line_end in zip(out.step_rewards, [len("\n".join(lines[:k])) for k in (1, 2, 3, 4)], strict=True):
        # the fewest tokens whose text reaches the line's end
        assert len(tokenizer.decode(ids[:step.end])) >= line_end > len(tokenizer.decode(ids[:step.end - 1]))
    assert out.step_rewards[-1].end == len(ids)


def test_a_final_turn_places_its_steps_after_the_context_and_an_agents_own_steps_stand(tokenizer):
    context = tokenizer.encode("tool says 3 + 4 = 8\n", add_special_tokens=False)
    answer = len(tokenizer.encode(WORKED, add_special_tokens=False))
    mask = [0] * len(context) + [1] * answer
    out, _ = scored(tokenizer, WORKED, mask=mask, prefix=context, response="final_turn")
    check_step_rewards(out)
    assert out.step_rewards[0].end > len(context) and len(out.step_rewards) == 4   # the tool's line is no step
    agent, _ = scored(tokenizer, WORKED)
    del agent.step_rewards[:]
    agent.step_rewards.add(end=2, reward=0.5)
    rescored = Scorer(lambda t: tokenizer.decode(t, skip_special_tokens=True), "math").score(agent)
    assert [(s.end, s.reward) for s in rescored.step_rewards] == [(2, 0.5)]


def test_steps_cross_the_worker_pool(tokenizer):
    pool = VerifierPool(workers=1)
    try:
        verdict = pool.score("arithmetic_chain", WORKED, {"answer": "13"}, 60.0)
    finally:
        pool.close()
    assert verdict == build_verifier("arithmetic_chain").score(WORKED, {"answer": "13"})


def test_grpo_process_trains_on_the_verifiers_steps(tokenizer):
    right, _ = scored(tokenizer, WORKED)
    wrong, _ = scored(tokenizer, WORKED.replace("7 * 2 = 15", "7 * 2 = 14").replace("13", "12"))
    for t, name in ((right, "a"), (wrong, "b")):
        t.trajectory_id, t.prompt_ids[:] = name, [1, 2]
    batch = pack([right, wrong], pad_token_id=0)
    assert batch.step_mask.sum().item() == 8
    algo = AlgorithmConfig.from_preset("grpo_process").build()
    adv = algo.compute_advantages(batch.rewards, batch.group_ids, batch.loss_mask, lengths=batch.lengths,
                                  truncated=batch.truncated, step_rewards=batch.step_rewards,
                                  step_mask=batch.step_mask).advantages
    # the rows' steps: right 1, 0, 1, 1 and wrong 1, 1, 0, 0 (its second line is right, its third and answer not),
    # normalised over the group's 8 steps; a step's last token is advanced by the sum from that step on
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.double)
    norm = ((rewards - rewards.mean()) / (rewards.flatten().std() + 1e-5)).float()
    to_go = norm.flip(-1).cumsum(-1).flip(-1)
    for r in range(2):
        ends = batch.step_mask[r].nonzero().flatten()
        torch.testing.assert_close(adv[r, ends], to_go[r])
