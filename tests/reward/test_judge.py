"""The LLM judge against real servers on loopback: a meshrl gateway over the embedded engine with a scripted
judge policy, a closed port, and a port that accepts and never answers."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import re
import socket
import time

import pytest

from launcher.processes import free_port
from services.common import grading
from services.common.config import ConfigError, load_config
from services.common.contracts import data_pb2
from services.reward.config import RewardConfig
from services.reward.scoring import Scorer
from services.reward.verifiers import build_verifier, judge
from services.reward.verifiers.judge import JudgeConfig, JudgeVerifier, parse_score
from tests.gateway.harness import GatewayServer
from tests.gateway.policies import scripted_engine, tokenizer

TASK = {"verifier": "llm_judge", "question": "What is the capital of France?", "answer": "Paris"}


def judge_replies(seen: list[str]):
    """The scripted judge: what it says depends on a marker in the graded response."""

    def reply(prompt: str, forced: str = "") -> str:
        seen.append(prompt)
        if "NO-SCORE" in prompt:
            return "I would rather not put a number on this."
        if "TWICE" in prompt:
            return "At first glance SCORE: 3, but on reflection it is right.\nSCORE: 9"
        if "OVER" in prompt:
            return "Outstanding. SCORE: 15"
        if "STEPWISE" in prompt:   # a step judge that skips step 3
            return "STEP 1: 10\nThe second is wrong. Step 2: 0\nSTEP 4: 7.5\nSCORE: 6"
        return "The answer is right. SCORE: 8"

    return reply


@pytest.fixture(scope="module")
def gateway():
    seen: list[str] = []
    tok = tokenizer()
    server = GatewayServer(scripted_engine(tok, judge_replies(seen)), tok).start()
    server.seen = seen
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key_file(gateway, tmp_path_factory):
    path = tmp_path_factory.mktemp("judge") / "key"
    path.write_text(gateway.start_session(task_id="judge")["api_key"] + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def config(gateway, key_file) -> JudgeConfig:
    return JudgeConfig(base_url=gateway.url + "/v1", model="judge", api_key_file=key_file, timeout_s=20,
                       max_retries=0, max_tokens=128)


@pytest.fixture
def restore_configured():
    before = judge.configured()
    yield
    judge.configure(before)


@pytest.fixture
def silent_port():
    """A loopback port whose backlog accepts connections that nobody ever reads or answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)
        time.sleep(seconds)


def test_the_gateway_judge_grades_with_the_rubric(gateway, config):
    verdict = JudgeVerifier(config).score("It is Paris.", TASK)
    assert verdict.reward == pytest.approx(0.8)
    assert "judge score 8" in verdict.detail
    prompt = gateway.seen[-1]
    assert "What is the capital of France?" in prompt and "Paris" in prompt and "It is Paris." in prompt
    assert "SCORE: <n>" in prompt


@pytest.mark.parametrize("response,reward", [("TWICE", 0.9), ("OVER", 1.0)])
def test_the_last_score_counts_and_is_clamped(config, response, reward):
    assert JudgeVerifier(config).score(response, TASK).reward == pytest.approx(reward)


def test_a_reply_without_a_score_gets_the_failure_reward(config):
    config = dataclasses.replace(config, failure_reward=-0.5)
    verdict = JudgeVerifier(config).score("NO-SCORE", TASK)
    assert verdict.reward == -0.5
    assert "no parsable score" in verdict.detail and "rather not" in verdict.detail


def test_a_step_judge_scores_each_line_it_was_shown_numbered(gateway, config):
    response = "STEPWISE 3 + 4 = 7\n7 * 2 = 15\n\n15 - 1 = 14\nso 14"
    verdict = JudgeVerifier(config).score(response, {**TASK, "verifier_options": {"steps": True}})
    assert "[1] STEPWISE 3 + 4 = 7\n[2] 7 * 2 = 15\n[3] 15 - 1 = 14\n[4] so 14" in gateway.seen[-1]
    assert "STEP <k>: <n>" in gateway.seen[-1]              # the step rubric asks for them
    ends = [len("STEPWISE 3 + 4 = 7"), len("STEPWISE 3 + 4 = 7\n7 * 2 = 15"), len(response)]
    assert [(s.end, s.reward) for s in verdict.steps] == list(zip(ends, [1.0, 0.0, 0.75], strict=True))
    assert verdict.reward == pytest.approx(0.6) and "1 of 4 steps unscored" in verdict.detail
    assert JudgeVerifier(config).score("It is Paris.", TASK).steps == ()   # outcome only unless asked


def test_task_options_override_the_rubric_and_model(gateway, config):
    task = {**TASK, "verifier_options": {"rubric": "Rate only this: {response} ({score_min}-{score_max})",
                                         "model": "other-judge", "max_tokens": 32}}
    assert JudgeVerifier(config).score("fine", task).reward == pytest.approx(0.8)
    assert "Rate only this: fine (0-10)" in gateway.seen[-1] and "capital" not in gateway.seen[-1]


def test_the_key_may_come_from_an_environment_variable(config, key_file, monkeypatch):
    monkeypatch.setenv("MESHRL_TEST_JUDGE_KEY", pathlib.Path(key_file).read_text().strip())
    env_config = dataclasses.replace(config, api_key_file="", api_key_env="MESHRL_TEST_JUDGE_KEY")
    assert JudgeVerifier(env_config).score("ok", TASK).reward == pytest.approx(0.8)


def test_a_refused_key_is_not_retried(config):
    sleeps = Sleeps()
    bad = dataclasses.replace(config, api_key_file="", api_key="not-a-session", max_retries=3)
    verdict = JudgeVerifier(bad, sleep=sleeps).score("ok", TASK)
    assert verdict.reward == 0.0 and "refused (attempt 1)" in verdict.detail and "401" in verdict.detail
    assert sleeps == []


def test_an_unreachable_judge_is_retried_with_backoff_then_fails():
    sleeps = Sleeps()
    config = JudgeConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", timeout_s=2, max_retries=3,
                         backoff_s=0.05, backoff_max_s=0.15, failure_reward=-1.0)
    start = time.monotonic()
    verdict = JudgeVerifier(config, sleep=sleeps).score("ok", TASK)
    assert time.monotonic() - start < 10
    assert verdict.reward == -1.0
    assert "unreachable after 4 attempts" in verdict.detail and "APIConnectionError" in verdict.detail
    assert sleeps == [0.05, 0.1, 0.15]  # doubling, capped


def test_scoring_a_silent_judge_keeps_the_event_loop_free(silent_port, restore_configured):
    """Through the service's async path: the judge times out on its worker thread while the loop keeps ticking."""
    judge.configure(JudgeConfig(base_url=f"http://127.0.0.1:{silent_port}/v1", model="m", timeout_s=0.5,
                                max_retries=1, backoff_s=0.05))
    scorer = Scorer(lambda ids: "", "math")

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def tick():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        start = time.monotonic()
        verdict = await scorer.score_text_async("llm_judge", "ok", TASK)
        elapsed = time.monotonic() - start
        done.set()
        await ticker
        return verdict, ticks, elapsed

    verdict, ticks, elapsed = asyncio.run(main())
    assert "unreachable after 2 attempts" in verdict.detail and "Timeout" in verdict.detail
    assert 1.0 <= elapsed < 15
    assert ticks >= 20  # the loop ran all along (a blocked loop would tick once)


def test_a_trajectory_is_scored_by_the_configured_judge(config, restore_configured):
    judge.configure(config)
    scorer = Scorer(lambda ids: "The capital is Paris.", "math")
    traj = data_pb2.Trajectory(trajectory_id="t-judge", prompt_ids=[1, 2], completion_ids=[3, 4],
                               behavior_logprobs=[-0.1, -0.2], versions=[0, 0], loss_mask=[1, 1],
                               grading=grading.to_proto(TASK))
    scored = asyncio.run(scorer.score_async(traj))
    assert scored.scored and scored.verifier == "llm_judge" and scored.reward == pytest.approx(0.8)


def test_an_unconfigured_judge_refuses_its_tasks_naming_the_field(restore_configured):
    judge.configure(JudgeConfig())
    with pytest.raises(ValueError, match=r"^judge\.base_url: no LLM judge is configured"):
        build_verifier("llm_judge").check(TASK)
    with pytest.raises(ValueError, match=r"^judge\.base_url"):
        Scorer(lambda ids: "", "math").score_text("llm_judge", "ok", TASK)


@pytest.mark.parametrize("options,field", [
    ({"temperature": 1.0}, "grading.verifier_options.temperature: unknown option"),
    ({"model": 3}, "grading.verifier_options.model: must be str"),
    ({"rubric": "no placeholder"}, "grading.verifier_options.rubric: must contain {response}"),
    ({"rubric": "{response} {secret}"}, "grading.verifier_options.rubric: unknown placeholder {secret}"),
    ({"rubric": "{response.__class__}"}, "grading.verifier_options.rubric: unknown placeholder"),
    ({"max_tokens": -1}, "grading.verifier_options.max_tokens: must be >= 0"),
    ("fast", "grading.verifier_options: must be a map"),
])
def test_bad_task_options_name_the_field(config, options, field):
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        JudgeVerifier(config).check({**TASK, "verifier_options": options})


def test_a_task_without_a_question_is_refused_unless_the_rubric_needs_none(config):
    with pytest.raises(ValueError, match=r"^grading\.question: missing"):
        JudgeVerifier(config).check({"answer": "Paris"})
    JudgeVerifier(config).check({"prompt": "Capital of France?"})
    JudgeVerifier(config).check({"verifier_options": {"rubric": "Grade {response}"}})


@pytest.mark.parametrize("judge_section,field", [
    ({"timeout_s": 0}, "reward.judge.timeout_s: must be > 0"),
    ({"max_retries": -1}, "reward.judge.max_retries: must be >= 0"),
    ({"base_url": "127.0.0.1:8000"}, "reward.judge.base_url: must start with http"),
    ({"base_url": "http://127.0.0.1:8000/v1"}, "reward.judge.model: required"),
    ({"score_min": 5, "score_max": 5}, "reward.judge.score_max: must be > score_min"),
    ({"rubric": "{answer}"}, "reward.judge.rubric: must contain {response}"),
    ({"api_key": "k", "api_key_file": "f"}, "reward.judge.api_key_env: set at most one"),
    ({"retries": 2}, "reward.judge.retries: unknown key"),
])
def test_bad_judge_config_names_the_field(judge_section, field):
    with pytest.raises(ConfigError) as err:
        load_config(RewardConfig, "reward", env={}, overrides={"judge": judge_section})
    assert str(err.value).startswith(field)


def test_configure_reads_the_key_at_start(tmp_path, restore_configured):
    missing = JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m", api_key_file=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"^judge\.api_key_file: cannot read"):
        judge.configure(missing)
    unset = JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m", api_key_env="MESHRL_TEST_UNSET_JUDGE_KEY")
    with pytest.raises(ValueError, match=r"^judge\.api_key_env: environment variable"):
        judge.configure(unset)
    judge.configure(JudgeConfig())  # disabled: nothing to read


@pytest.mark.parametrize("reply,score", [
    ("SCORE: 7", 7.0), ("score = 6.5/10", 6.5), ("**Score:** 4", 4.0), ("SCORE: 2 ... final SCORE: 9", 9.0),
    ("I scored it well", None), ("", None), ("SCORE: -3", -3.0),
])
def test_parse_score_takes_the_last(reply, score):
    assert parse_score(reply) == score
