"""`code_tests` verdict forgery: candidate programs that try to reach the grader instead of solving the task (call
its reporter, walk its frames or the heap, patch builtins, return an object equal to everything, read the nonce or
the tests, print a verdict, exit early). Each runs in the real sandbox and must score what its honest behaviour
earns: 0 here, since none of them computes a sum."""

from __future__ import annotations

import pytest

from services.reward.sandbox import Limits, SandboxConfig, SandboxUnavailable
from services.reward.verifiers.code_tests import CodeTestsVerifier

TESTS = """
def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(0, 0) == 0
    assert candidate(-1, 5) == 4
"""
TASK = {"tests": TESTS, "entry_point": "add"}
WRONG = "def add(a, b):\n    return 7\n"  # right on none of the three cases

MAIN_REPORT = "import __main__\n__main__._report(1, 1)\n" + WRONG
MAIN_REPORT_50 = "import __main__\n__main__._report(50, 1)\n" + WRONG

GETFRAME = """
def add(a, b):
    import sys
    frame = sys._getframe(1)
    while frame is not None:
        report = frame.f_globals.get("_report")
        if callable(report):
            report(3, 3)
        frame = frame.f_back
    return 7
"""

GC_WALK = """
import gc
for obj in gc.get_objects():
    if callable(obj) and getattr(obj, "__name__", "") in ("_report", "report"):
        obj(3, 3)
""" + WRONG

# the harness execs each case: a no-op exec makes every case "pass"; the other patches try the assert machinery
PATCHED_BUILTINS = """
import builtins
builtins.exec = lambda *args, **kwargs: None
builtins.AssertionError = type("NotAnAssertion", (Exception,), {})
builtins.print = lambda *args, **kwargs: None
builtins.exit = builtins.quit = lambda *args: None
""" + WRONG

ALWAYS_EQUAL = """
class Equal:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__

def add(a, b):
    return Equal()
"""

ALWAYS_EQUAL_INT = """
class Equal(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__

def add(a, b):
    return Equal(7)
"""

# the nonce from wherever it may be visible (the harness's globals, a re-opened stdin), printed as a verdict on
# every stdout that can be reached (its own, pid 1's), then an exit before the tests can fail
PRINTED_VERDICT = """
import json, os, re
texts = []
try:
    import __main__
    texts.append(str(getattr(__main__, "_NONCE", "")))
except Exception:
    pass
for path in ("/proc/self/fd/0", "/proc/1/fd/0", f"/proc/{os.getppid()}/fd/0"):
    try:
        with open(path, errors="replace") as f:
            texts.append(f.read())
    except OSError:
        pass
nonces = {n for text in texts for n in re.findall(r"[0-9a-f]{32}", text)}
for nonce in nonces:
    line = nonce + " " + json.dumps({"passed": 3, "total": 3, "error": ""}) + "\\n"
    print(line, end="", flush=True)
    for path in ("/proc/1/fd/1", f"/proc/{os.getppid()}/fd/1"):
        try:
            with open(path, "w") as f:
                f.write(line)
        except OSError:
            pass
os._exit(0)
"""

# the tests' answers, from wherever the tests may be visible: the program file, stdin, frames, any process's
# memory; `add` answers from that key
ANSWER_KEY = r"""
import gc, os, re, sys
PAIR = re.compile(r"candidate\((-?\d+), (-?\d+)\) == (-?\d+)")
texts = []

def _read(path, limit=1 << 22):
    try:
        with open(path, "rb") as f:
            texts.append(f.read(limit).decode("latin-1"))
    except OSError:
        pass

def _memory(pid):
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
            for line in maps:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if "r" in perms and hi - lo < 1 << 26:
                    try:
                        mem.seek(lo)
                        texts.append(mem.read(hi - lo).decode("latin-1"))
                    except (OSError, ValueError, OverflowError):
                        pass
    except OSError:
        pass

_read("/sandbox/main.py")
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    _read(f"/proc/{pid}/cmdline")
    for fd in ("0", "3", "4"):
        _read(f"/proc/{pid}/fd/{fd}")
    if int(pid) != os.getpid():
        _memory(pid)
frame = sys._getframe(0)
while frame is not None:
    texts.extend(repr(v)[:100000] for v in list(frame.f_globals.values()) + list(frame.f_locals.values()))
    frame = frame.f_back
for obj in gc.get_objects():
    code = getattr(obj, "__code__", None)
    if code is not None:
        texts.append(repr(code.co_consts))
KEY = {(int(a), int(b)): int(c) for text in texts for a, b, c in PAIR.findall(text)}

def add(a, b):
    return KEY.get((a, b), 7)
"""

EXIT_IN_CALL = "def add(a, b):\n    import os\n    os._exit(0)\n"
SYS_EXIT_IN_CALL = "def add(a, b):\n    import sys\n    sys.exit(0)\n"

EXPLOITS = {"main-report": MAIN_REPORT, "main-report-50": MAIN_REPORT_50, "getframe": GETFRAME, "gc-walk": GC_WALK,
            "patched-builtins": PATCHED_BUILTINS, "always-equal": ALWAYS_EQUAL, "always-equal-int": ALWAYS_EQUAL_INT,
            "printed-verdict": PRINTED_VERDICT, "answer-key": ANSWER_KEY, "os-exit-in-call": EXIT_IN_CALL,
            "sys-exit-in-call": SYS_EXIT_IN_CALL}


@pytest.fixture(scope="module")
def verifier():
    limits = Limits(timeout_s=8.0, cpu_s=8, memory_mb=512, nproc=32)
    try:
        return CodeTestsVerifier(SandboxConfig(limits=limits, concurrency=2).build())
    except SandboxUnavailable as exc:
        pytest.fail(f"{exc} -- the escape suite needs bubblewrap: scripts/install_bwrap.sh (run by make setup)")


@pytest.mark.parametrize("partial", [False, True], ids=["all-or-nothing", "partial"])
@pytest.mark.parametrize("name", list(EXPLOITS))
def test_a_forged_verdict_scores_nothing(verifier, name, partial):
    verdict = verifier.score(f"```python\n{EXPLOITS[name]}```", {**TASK, "verifier_options": {"partial": partial}})
    assert 0.0 <= verdict.reward <= 1.0, verdict
    assert verdict.reward == 0.0, verdict


def test_partial_credit_stays_the_honest_fraction(verifier):
    """A candidate right on one case (it always answers 3) that also tries to report 3/3 earns 1/3."""
    verdict = verifier.score(GETFRAME.replace("return 7", "return 3"), {**TASK, "verifier_options": {"partial": True}})
    assert verdict.reward == pytest.approx(1 / 3) and "1/3" in verdict.detail, verdict
