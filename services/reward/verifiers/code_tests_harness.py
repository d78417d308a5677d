"""The `code_tests` harness. It runs INSIDE the sandbox as the program (the system python, stdlib only). The service
never imports it: code_tests.py sends its text as the program, and the task on stdin.

Why two processes. Code that runs in the grader's interpreter can reach the grader: `import __main__`, frames
(`sys._getframe`), the heap (`gc`), builtins, an object equal to everything, a printed verdict, `os._exit`. So:

- the candidate process is forked first thing, before the judge has read anything, so its memory holds this
  file's code and nothing secret (a fork, not a second interpreter: ~25 ms less per program). It closes the
  sandbox's stdin and stdout, gets the solution over a pipe, runs it, and then answers calls. A call sends a name
  and arguments as plain data; the answer is the return value, or the exception, as plain data. The candidate
  never sees the tests or the nonce. Its own stdout goes to /dev/null.
- the judge makes itself non-dumpable: no other process of the sandbox (same uid, no capabilities) can then read
  its memory or fds, or ptrace it. Then it reads the task from stdin (a JSON object: the nonce, the solution, the
  test plan) and erases it: it truncates the stdin file, which the sandbox's pid 1 also holds open (the service
  opens it read-write). Only then does it send the solution. It ignores SIGINT, which would raise inside the tests.
- the judge runs the tests. Every name the tests take from the solution (the entry point, prompt helpers) is bound
  to a proxy that makes such a call. So each assert and each comparison runs in the judge, on genuine builtin
  values. The judge prints the verdict line last, prefixed with the nonce.

Plain data is None, bool, int, float, complex, str, bytes and list, tuple, dict, set, frozenset of them. An instance
of a subclass crosses as its base type's value: an `int` subclass equal to everything arrives as its int. Any other
type, an object equal to everything included, fails the call, so an `assert candidate(x) == y` compares two
builtin values. Arguments cross the same way (a copy: a test cannot see the candidate mutate its argument). A
candidate that raises a builtin exception (except StopIteration, which could end the tests' own loops early)
raises the same type in the judge; any other type raises CandidateError.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import sys
import traceback

MAX_MESSAGE = 16 << 20  # bytes per pipe message: a bigger answer fails its call
MAX_DEPTH = 200         # nesting of plain data
PR_SET_DUMPABLE = 4
NOT_RAISED = (StopIteration, StopAsyncIteration)


class CandidateError(Exception):
    """The candidate raised a non-builtin exception, gave an answer that is not plain data, or exited."""


# -- plain data: a JSON tree, containers as [tag, items] --

_CONTAINERS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_BASES = (bool, int, float, str, bytes, complex, list, tuple, dict, set, frozenset)


def encode(value, depth=0):
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if depth > MAX_DEPTH:
        raise TypeError("the value is nested too deeply")
    if kind in _CONTAINERS:
        return [_CONTAINERS[kind], [encode(item, depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is complex:
        return ["complex", [value.real, value.imag]]
    for base in _BASES:
        if isinstance(value, base):
            return encode(base(value), depth)
    raise TypeError(f"a {kind.__name__} is not plain data")


def decode(tree, depth=0):
    """Only builtin values come out, whatever the tree (it comes from the candidate)."""
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if type(tree) is not list or len(tree) != 2 or type(tree[0]) is not str or depth > MAX_DEPTH:
        raise ValueError("not an encoded value")
    tag, body = tree
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) is float for x in body):
        return complex(*body)
    if type(body) is not list:
        raise ValueError("not an encoded value")
    if tag == "dict":
        if not all(type(pair) is list and len(pair) == 2 for pair in body):
            raise ValueError("not an encoded dict")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    kinds = {name: kind for kind, name in _CONTAINERS.items()}
    if tag not in kinds:
        raise ValueError(f"unknown tag {tag!r}")
    return kinds[tag](decode(item, depth + 1) for item in body)


def send(stream, message):
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def receive(stream):
    line = stream.readline(MAX_MESSAGE + 1)
    if not line.endswith(b"\n"):
        raise EOFError("the message is too large" if len(line) > MAX_MESSAGE else "the candidate exited")
    message = json.loads(line)
    if type(message) is not dict:
        raise ValueError("not a message")
    return message


def why(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


# -- the candidate: runs the solution, answers calls --

def fork_candidate():
    """(pid, calls, answers): the candidate process and the judge's ends of its two pipes."""
    calls_r, calls_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(calls_w)
            os.close(answers_r)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)  # the sandbox's stdin (the task, until the judge erases it) and stdout (the verdict)
            os.dup2(null, 1)
            os.close(null)
            candidate_main(os.fdopen(calls_r, "rb"), os.fdopen(answers_w, "wb"))
        finally:
            os._exit(0)
    os.close(calls_r)
    os.close(answers_w)
    return pid, os.fdopen(calls_w, "wb"), os.fdopen(answers_r, "rb")


def candidate_main(calls, answers):
    try:
        start = receive(calls)
    except (EOFError, ValueError):
        return
    ns = {"__name__": "solution"}
    try:
        exec(compile(start["solution"], "solution.py", "exec"), ns)
    except BaseException as exc:  # noqa: BLE001 - whatever the solution raises (SystemExit too) is its verdict
        send(answers, {"error": "solution: " + why(exc)})
        return
    send(answers, {"names": {name: describe(ns[name]) for name in start["names"] if name in ns}})
    while True:
        try:
            call = receive(calls)
        except EOFError:
            return
        send(answers, answer(ns, call))


def describe(value):
    """How the judge binds a name the tests take from the solution: a proxy, the module of that name, or data."""
    if type(value).__name__ == "module":
        return ["module"]
    if callable(value):
        return ["call"]
    try:
        return ["data", encode(value)]
    except TypeError:
        return ["call"]  # not data: any use fails in the judge


def answer(ns, call):
    try:
        args, kwargs = decode(call["args"]), decode(call["kwargs"])
        return {"value": encode(ns[call["name"]](*args, **kwargs))}
    except BaseException as exc:  # noqa: BLE001 - reported to the judge, which raises it in the tests
        try:
            return {"raised": type(exc).__name__, "message": str(exc)[-500:]}
        except BaseException:  # noqa: BLE001 - a __str__ that raises
            return {"raised": "Exception", "message": ""}


# -- the judge: holds the nonce and the tests, runs the tests with proxies --

class Candidate:
    def __init__(self, process, solution, names):
        self.pid, self.calls, self.answers = process
        self.names, self.error = {}, ""
        try:
            send(self.calls, {"solution": solution, "names": names})
            reply = receive(self.answers)
        except (EOFError, ValueError, RecursionError, OSError) as exc:
            self.error = f"solution: {exc} before it was ready"
            return
        self.error = str(reply.get("error", ""))
        names = reply.get("names", {})
        self.names = {k: v for k, v in names.items() if type(v) is list and v} if type(names) is dict else {}

    def call(self, name, args, kwargs):
        message = {"name": name, "args": encode(list(args)), "kwargs": encode(dict(kwargs))}
        try:
            send(self.calls, message)
            reply = receive(self.answers)
            if "value" in reply:
                return decode(reply["value"])
        except (EOFError, ValueError, RecursionError, OSError) as exc:
            raise CandidateError(f"{name}: {exc}") from None
        raise raised(name, reply)

    def proxy(self, name):
        def call(*args, **kwargs):
            return self.call(name, args, kwargs)
        call.__name__ = call.__qualname__ = name
        return call

    def bind(self, name, ns):
        how = self.names.get(name)
        if how is None:
            return
        try:
            if how[0] == "module":
                ns[name] = __import__(name)  # only the module of that very name, imported here
            elif how[0] == "data" and len(how) == 2:
                ns[name] = decode(how[1])
            else:
                ns[name] = self.proxy(name)
        except (ImportError, ValueError, TypeError, RecursionError):
            pass  # left unbound: the tests' use of it fails

    def close(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def raised(name, reply):
    kind, message = reply.get("raised"), str(reply.get("message", ""))
    builtin = getattr(builtins, kind, None) if type(kind) is str else None
    if isinstance(builtin, type) and issubclass(builtin, Exception) and not issubclass(builtin, NOT_RAISED):
        try:
            return builtin(message)
        except Exception:  # noqa: BLE001 - a builtin exception that takes other arguments
            pass
    return CandidateError(f"{name} raised {kind}: {message}")


def judge(process, task):
    """(passed, first error) for the task's plan."""
    plan, entry = task["plan"], task["entry"]
    names = sorted({n for n in plan["names"] if not hasattr(builtins, n)} | ({entry} if entry else set()))
    candidate = Candidate(process, task["solution"], names)
    try:
        if candidate.error:
            return 0, candidate.error
        if entry and candidate.names.get(entry, [""])[0] != "call":
            return 0, "the code does not define " + entry
        return run_cases(plan, entry, candidate)
    finally:
        candidate.close()


def run_cases(plan, entry, candidate):
    ns = {"__name__": "tests"}
    for name in plan["names"]:
        if not hasattr(builtins, name):
            candidate.bind(name, ns)
    try:
        exec(compile(plan["setup"], "tests.py", "exec"), ns)
        if entry:
            ns[plan["param"] or "__candidate__"] = candidate.proxy(entry)
    except BaseException as exc:  # noqa: BLE001 - broken tests score nothing, saying why
        return 0, "tests: " + why(exc)
    passed, first_error = 0, ""
    for kind, source in plan["cases"]:
        try:
            exec(compile(source, "tests.py", "exec"), ns)
            passed += kind == "assert"
        except BaseException as exc:  # noqa: BLE001 - a failed case, whatever it raised
            first_error = first_error or why(exc)
            if kind == "stmt":
                break
    return passed, first_error


def read_task():
    """The task from stdin, once this process is out of the candidate's reach; then stdin is erased."""
    import ctypes  # the judge's alone: the candidate process is forked before

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    data = sys.stdin.buffer.read()
    os.ftruncate(0, 0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    return json.loads(data)


def main():
    process = fork_candidate()  # first: nothing secret is in this process yet
    try:
        task = read_task()
    except BaseException:
        os.kill(process[0], signal.SIGKILL)
        raise
    nonce = task.pop("nonce")
    try:
        passed, error = judge(process, task)
    except BaseException as exc:  # noqa: BLE001 - a harness failure is a verdict of 0 that says why
        passed, error = 0, "harness: " + why(exc)
    sys.stdout.write(nonce + " " + json.dumps({"passed": passed, "error": error[-2000:]}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
