"""Format and length shaping terms add to the correctness verifier's reward; malformed terms name the entry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common import grading
from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.reward.scoring import Scorer


def scorer(**kw) -> Scorer:
    return Scorer(lambda ids: "".join(map(chr, ids)), "exact", **kw)


FORMAT = {"name": "format", "weight": 0.25}


@pytest.mark.parametrize("response,shaping,reward", [
    ("<answer>7</answer>", [FORMAT], 1.25),                              # correct and tagged
    ("<answer>8</answer>", [FORMAT], 0.25),                              # wrong but tagged
    ("7", [FORMAT], 0.0),                                                # untagged: extract "tag" finds nothing
    ("<answer>7</answer>", [{"name": "format", "pattern": r"^<answer>\d+</answer>$", "fullmatch": True}], 1.1),
    ("<answer>7</answer>" + "x" * 12, [{"name": "length", "max_chars": 20, "weight": 0.5}], 1.0 - 0.5 * 10 / 20),
    ("<answer>7</answer>" + "x" * 99, [{"name": "length", "max_chars": 20, "weight": 0.5}], 0.5),  # capped at weight
    ("<answer>7</answer>", [FORMAT, {"name": "length", "max_chars": 9, "weight": 0.1}], 1.25 - 0.1),
])
def test_terms_add_to_the_correctness_reward(response, shaping, reward):
    task = {"answer": "7", "extract": "tag", "shaping": shaping}
    verdict = scorer().score_text("exact", response, task)
    assert verdict.reward == pytest.approx(reward)
    assert verdict.detail.count(";") == len(shaping)


def test_max_tokens_counts_completion_tokens_or_asks_for_a_counter():
    task = {"answer": "7", "shaping": [{"name": "length", "max_tokens": 2, "weight": 1.0}]}
    traj = data_pb2.Trajectory(trajectory_id="t", completion_ids=[55, 32, 32, 32], versions=[0] * 4,
                               behavior_logprobs=[0.0] * 4, loss_mask=[1] * 4, grading=grading.to_proto(task))
    assert scorer().score(traj).reward == pytest.approx(1.0 - 1.0)  # 4 tokens: twice the limit, the full penalty
    with pytest.raises(ValueError, match="grading.shaping: max_tokens needs a token count"):
        scorer().score_text("exact", "7", task)
    assert scorer(count_tokens=lambda text: 3).score_text("exact", "7", task).reward == pytest.approx(0.5)


@pytest.mark.parametrize("shaping,field", [
    ({"name": "format"}, "grading.shaping: must be a list"),
    (["format"], r"grading.shaping\[0\]: must be a map"),
])
def test_terms_of_the_wrong_shape_are_refused_where_the_grading_is_built(shaping, field):
    with pytest.raises(ValueError, match=field):
        grading.to_proto({"answer": "7", "shaping": shaping})
    with pytest.raises(ValueError, match=field):
        scorer().score_text("exact", "7", {"answer": "7", "shaping": shaping})  # the scorer checks a map it is handed too


@pytest.mark.parametrize("shaping,field", [
    ([FORMAT, {"name": "brevity"}], r"grading.shaping\[1\].name: unknown 'brevity'"),
    ([{"name": "format", "pattern": "("}], r"grading.shaping\[0\].pattern: not a regular expression"),
    ([{"name": "format", "weight": "high"}], r"grading.shaping\[0\].weight: must be float"),
    ([{"name": "length"}], r"grading.shaping\[0\]: give one of max_chars, max_tokens"),
    ([{"name": "length", "max_chars": 5, "max_tokens": 5}], r"grading.shaping\[0\]: give one of"),
    ([{"name": "length", "max_char": 5}], r"grading.shaping\[0\].max_char: unknown option"),
])
def test_malformed_terms_are_invalid_messages_naming_the_entry(shaping, field):
    task = {"answer": "7", "shaping": shaping}
    traj = data_pb2.Trajectory(trajectory_id="t", completion_ids=[55], versions=[0], behavior_logprobs=[0.0],
                               loss_mask=[1], grading=grading.to_proto(task))
    with pytest.raises(InvalidMessage, match=field):
        scorer().score(traj)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(), st.text(max_size=12))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                              max_size=3), max_leaves=8)
_keys = st.sampled_from(["answer", "verifier", "verifier_options", "shaping", "extract", "rg_entry", "x"])
_options = st.dictionaries(st.sampled_from(["pattern", "casefold", "numbers", "strip", "weight"]), _values, max_size=3)
_shaping = st.lists(st.dictionaries(st.sampled_from(["name", "pattern", "weight", "max_chars", "max_tokens"]),
                                    st.one_of(st.sampled_from(["format", "length", "(x)"]), _values), max_size=4),
                    max_size=3)


@settings(max_examples=300, deadline=None)
@given(task=st.dictionaries(_keys, _values, max_size=5), options=_options, shaping=_shaping,
       verifier=st.sampled_from(["exact", "regex", "reasoning_gym:chain_sum"]), response=st.text(max_size=40))
def test_any_grading_is_scored_or_refused_with_a_value_error(task, options, shaping, verifier, response):
    task = {**task, "verifier_options": options, "shaping": shaping}
    s = scorer(count_tokens=len)
    try:
        s.verifier(verifier).check(task)
        if verifier == "reasoning_gym:chain_sum":
            return  # checked only: its scorer runs in the worker pool (test_verifier_timeouts)
        verdict = s.score_text(verifier, response, task)
    except ValueError as exc:
        assert str(exc).split(":")[0].startswith(("grading", "verifier"))
        return
    assert isinstance(verdict.reward, float)
