"""tests/lines.read_line: a child that never prints the awaited line fails the test within the deadline, naming it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.lines import read_line


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_child_that_never_prints_fails_within_the_deadline_naming_what_was_awaited():
    proc = spawn("import time; time.sleep(120)")
    started = time.monotonic()
    try:
        with pytest.raises(AssertionError, match=rf"no line from pid {proc.pid} \(its ready line\) within 1s; "
                                                 r"exit code None"):
            read_line(proc, 1.0, "its ready line")
        assert time.monotonic() - started < 10
    finally:
        proc.kill()
        proc.wait(30)


def test_a_child_that_exits_silently_is_named_with_its_exit_code():
    proc = spawn("import sys; sys.exit(3)")
    proc.wait(30)
    with pytest.raises(AssertionError, match=r"closed its stdout before its ready line; exit code 3"):
        read_line(proc, 30.0, "its ready line")


def test_the_line_is_returned():
    proc = spawn("print('ready', flush=True)")
    try:
        assert read_line(proc, 30.0, "its ready line") == "ready\n"
    finally:
        proc.wait(30)
