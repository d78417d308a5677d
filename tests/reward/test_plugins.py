"""examples/custom_verifier, pip-installed into a temporary target, is found through the `meshrl.verifiers` entry
points, scores in the worker processes, and ListVerifiers over a real gRPC server shows it with the built-ins."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import grpc
import pytest

from services.common import grading
from services.common.contracts import reward_pb2, reward_pb2_grpc
from services.common.deadletters import DeadLetterWatch
from services.common.rpc import Servicer, channel, start_server
from services.reward.sandbox import SandboxConfig
from services.reward.scoring import Scorer
from services.reward.server import RewardServicer
from services.reward.verifiers import build_verifier, plugins
from services.reward.verifiers.pool import VerifierPool

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "custom_verifier"
TASK = {"answer": "-", "verifier": "keywords", "verifier_options": {"keywords": ["Paris", "France"]}}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example installed as a user would, offline: its entry point visible here and in worker processes."""
    src, target = tmp_path_factory.mktemp("src") / "custom_verifier", tmp_path_factory.mktemp("site")
    shutil.copytree(EXAMPLE, src)  # the build writes build/ and *.egg-info next to its sources
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(target), str(src)], check=True, timeout=300)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(target))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])))
        yield target


@pytest.fixture(scope="module")
def pool(installed):
    pool = VerifierPool(workers=1)  # started after the install: its workers see the plugin
    yield pool
    pool.close()


def scorer(pool: VerifierPool) -> Scorer:
    return Scorer(lambda ids: "".join(map(chr, ids)), "math", timeout_s=30, pool=pool)


def test_the_plugin_is_discovered_through_its_entry_point(installed):
    assert plugins.discover()["keywords"].value == "meshrl_custom_verifier:KeywordVerifier"
    v = build_verifier("keywords")
    assert v.isolated
    assert v.score("Paris is lovely", TASK).reward == 0.5


def test_the_plugin_scores_in_a_worker_with_a_deadline(pool):
    verdict = scorer(pool).score_text("keywords", "Paris, the capital of France", TASK)
    assert verdict.reward == 1.0 and "France" in verdict.detail
    shaped = {**TASK, "shaping": [{"name": "length", "max_chars": 5, "weight": 0.5}]}
    assert scorer(pool).score_text("keywords", "Paris", shaped).reward == 0.5


def test_the_plugins_own_check_names_the_field(pool):
    with pytest.raises(ValueError, match="grading.verifier_options.keywords"):
        scorer(pool).score_text("keywords", "Paris", {**TASK, "verifier_options": {}})


async def test_list_verifiers_and_score_over_grpc(pool):
    servicer = RewardServicer(scorer(pool), {"scored": 0.0, "reward_sum": 0.0}, DeadLetterWatch(bus=None),
                              SandboxConfig())
    rpc = await start_server("127.0.0.1:0", [Servicer(
        reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer,
        reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name)])
    try:
        async with channel(f"127.0.0.1:{rpc.port}") as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            names = list((await stub.ListVerifiers(reward_pb2.ListVerifiersRequest())).verifiers)
            assert {"math", "exact", "regex", "keywords", "reasoning_gym:countdown"} <= set(names)
            assert names == sorted(names)
            reply = await stub.Score(reward_pb2.ScoreRequest(verifier="keywords", response="France",
                                                             grading=grading.to_proto(TASK)))
            assert reply.reward == 0.5
            for verifier, task, field in [("nope", TASK, "verifier: unknown 'nope'"),
                                          ("regex", {"answer": "1"}, "grading.verifier_options.pattern: missing")]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Score(reward_pb2.ScoreRequest(verifier=verifier, response="1",
                                                             grading=grading.to_proto(task)))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)
    finally:
        await rpc.stop()


def test_plugin_results_and_failures_are_adapted():
    class Picky:
        def check(self, task):
            task["needed"]

        def score(self, response, task):
            return float(response)

    v = plugins.PluginVerifier("picky", Picky())
    with pytest.raises(ValueError, match="grading: refused by plugin 'picky' \\(KeyError"):
        v.check({})
    assert v.score("0.25", {}).reward == 0.25
    with pytest.raises(RuntimeError, match="non-finite"):  # in a worker: an "error" verdict of 0
        v.score("nan", {})
    assert plugins.PluginVerifier("f", lambda response, task: (1, "ok")).score("", {}).detail == "ok"
