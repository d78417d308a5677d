"""The registry's verifiers on examples, and their option errors naming the field."""

from __future__ import annotations

import pytest
import reasoning_gym

from services.reward.verifiers import build_verifier, verifier_names
from services.reward.verifiers.normalize import Normalization, canonical_number


@pytest.mark.parametrize("text,expected", [("1,000", "1000"), ("+1000", "1000"), ("1000.00", "1000"), ("1e3", "1000"),
                                           ("-0", "0"), ("0.50", "0.5"), ("12,34", "12,34"), ("x1", "x1"),
                                           ("1e999999999", "1e999999999")])
def test_numbers_are_canonical_only_when_the_whole_text_is_one(text, expected):
    assert canonical_number(text) == expected


def test_normalization_options_compose():
    norm = Normalization(casefold=True, collapse_whitespace=True, strip_period=True)
    assert norm.apply("  New   York. ") == "new york"
    assert norm.apply("Wait...") == "wait..."
    assert Normalization().apply(" A  b ") == "A  b"


def test_exact_takes_normalization_options():
    exact = build_verifier("exact")
    assert exact.score(" yes ", {"answer": "yes"}).reward == 1.0
    assert exact.score("Yes.", {"answer": "yes"}).reward == 0.0
    options = {"casefold": True, "strip_period": True}
    assert exact.score("Yes.", {"answer": "yes", "verifier_options": options}).reward == 1.0
    assert exact.score("so 1,200", {"answer": "1200", "extract": "last_number",
                                     "verifier_options": {"numbers": True}}).reward == 0.0  # last_number reads "200"
    assert exact.score("1,200.0", {"answer": "1200", "verifier_options": {"numbers": True}}).reward == 1.0


REGEX = {"pattern": r"[Aa]nswer:\s*(.+)"}


@pytest.mark.parametrize("response,options,reward", [
    ("Answer: Paris", {}, 1.0),
    ("answer: paris", {}, 0.0),
    ("answer: PARIS.", {"casefold": True, "strip_period": True}, 1.0),
    ("Answer: Rome\nAnswer: Paris", {}, 1.0),  # the last match is the final answer
    ("Paris", {}, 0.0),
])
def test_regex_verifier_compares_the_captured_group(response, options, reward):
    task = {"answer": "Paris", "verifier": "regex", "verifier_options": {**REGEX, **options}}
    assert build_verifier("regex").score(response, task).reward == reward


def test_regex_prefers_a_group_named_answer_and_normalises_numbers():
    task = {"answer": "1234", "verifier_options": {"pattern": r"(total|sum)\D*(?P<answer>[\d,.]+)", "numbers": True,
                                                   "strip_period": True}}
    assert build_verifier("regex").score("the total is 1,234.", task).reward == 1.0


@pytest.mark.parametrize("options,field", [
    ({}, "grading.verifier_options.pattern: missing"),
    ({"pattern": "("}, "grading.verifier_options.pattern: not a regular expression"),
    ({"pattern": "answer"}, "grading.verifier_options.pattern: needs a capture group"),
    ({"pattern": "(x)", "casefold": "yes"}, "grading.verifier_options.casefold: must be bool"),
    ({"pattern": "(x)", "ignore_case": True}, "grading.verifier_options.ignore_case: unknown option"),
    ("(x)", "grading.verifier_options: must be a map"),
])
def test_regex_options_errors_name_the_field(options, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        build_verifier("regex").check({"answer": "1", "verifier_options": options})


def test_verifiers_without_options_refuse_them():
    with pytest.raises(ValueError, match="grading.verifier_options.pattern: unknown option"):
        build_verifier("math").check({"answer": "1", "verifier_options": {"pattern": "(x)"}})


def test_reasoning_gym_families_score_with_their_own_scorer():
    entry = reasoning_gym.create_dataset("countdown", seed=3, size=1)[0]
    task = {"answer": entry["answer"], "rg_entry": entry, "extract": "tag"}
    v = build_verifier("reasoning_gym:countdown")
    v.check(task)
    assert v.isolated
    assert v.score(f"so <answer>{entry['answer']}</answer>", task).reward == 1.0
    assert v.score("<answer>1 + 1</answer>", task).reward < 0.1  # countdown's own partial credit for a wrong one
    chain = reasoning_gym.create_dataset("chain_sum", seed=3, size=1)[0]
    assert build_verifier("reasoning_gym:chain_sum").score(chain["answer"], {"rg_entry": chain}).reward == 1.0


@pytest.mark.parametrize("task,field", [
    ({}, "grading.rg_entry: missing"),
    ({"rg_entry": {"question": "q", "answer": "a"}}, "grading.rg_entry.metadata: missing"),
    ({"rg_entry": {"question": "q", "answer": "a", "metadata": {}}, "extract": "first"}, "grading.extract"),
])
def test_reasoning_gym_tasks_are_checked(task, field):
    with pytest.raises(ValueError, match=field):
        build_verifier("reasoning_gym:chain_sum").check(task)


@pytest.mark.parametrize("name,message", [("reasoning_gym:nope", "verifier: unknown reasoning-gym family 'nope'"),
                                          ("nope", "verifier: unknown 'nope'")])
def test_unknown_names_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        build_verifier(name)


def test_names_list_builtins_and_every_reasoning_gym_family():
    names = verifier_names()
    assert {"math", "exact", "regex", "reasoning_gym:countdown"} <= set(names)
    assert sum(n.startswith("reasoning_gym:") for n in names) == len(reasoning_gym.factory.DATASETS)
