"""What bench/trl_compare.py measures of one run, the same way for meshrl and for TRL: the timed window (from the
first generation to the last optimizer step), the CPU its process tree spent inside it, and the held-out curve
(the checkpoints written inside it, each at the moment its weights existed).

No meshrl or TRL import: the figures come from a run's own records (meshrl's metrics.jsonl, TRL's result.json)
and from /proc samples of the process tree taken while it ran.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import pathlib
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

PROC = pathlib.Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_EVERY_S = 0.2


def tree_usage(root: int) -> tuple[float, int]:
    """(CPU-seconds, resident bytes) of `root` and its live descendants, from one pass over /proc. A process's
    CPU includes the children it has waited for, so a service that exited and was reaped still counts."""
    table: dict[int, tuple[int, float, int]] = {}
    for entry in os.scandir(PROC):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                text = pathlib.Path(entry.path, "stat").read_text()
                fields = text[text.rindex(")") + 2:].split()  # fields[0] is the man page's field 3 (state)
                cpu = sum(int(x) for x in fields[11:15]) / TICKS  # utime stime cutime cstime
                table[int(entry.name)] = (int(fields[1]), cpu, int(fields[21]) * PAGE)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    cpu, rss, todo = 0.0, 0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            cpu, rss = cpu + table[pid][1], rss + table[pid][2]
            todo += children.get(pid, [])
    return cpu, rss


@dataclass
class Measured:
    """One command's run: its wall seconds, peak summed RSS, and (Unix time, tree CPU-seconds) samples."""

    seconds: float
    peak_rss_bytes: int
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)

    def cpu_at(self, at: float) -> float:
        """The tree's CPU-seconds at Unix time `at`, interpolated between the samples around it."""
        times = [t for t, _ in self.cpu_samples]
        if not times:
            return 0.0
        i = bisect.bisect_left(times, at)
        if i == 0:
            return self.cpu_samples[0][1]
        if i == len(times):
            return self.cpu_samples[-1][1]
        (t0, c0), (t1, c1) = self.cpu_samples[i - 1], self.cpu_samples[i]
        return c0 + (c1 - c0) * (at - t0) / (t1 - t0) if t1 > t0 else c1

    def cpu_between(self, start: float, end: float) -> float:
        return max(0.0, self.cpu_at(end) - self.cpu_at(start))


def run_measured(cmd: list[str], *, cpus: list[int] | None, timeout: float, **kwargs) -> Measured:
    """Run `cmd` (on `cpus` only, its children included, when given) to success within `timeout` seconds, sampling
    its process tree every 0.2 s. Past the timeout: SIGTERM (a meshrl stack stops its services), then SIGKILL, and
    a RuntimeError naming the command."""
    def pinned() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    started = time.perf_counter()
    proc = subprocess.Popen(cmd, preexec_fn=pinned, **kwargs)
    measured = Measured(0.0, 0)

    def sample() -> None:
        while proc.poll() is None:
            cpu, rss = tree_usage(proc.pid)
            measured.cpu_samples.append((time.time(), cpu))
            measured.peak_rss_bytes = max(measured.peak_rss_bytes, rss)
            time.sleep(SAMPLE_EVERY_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        raise RuntimeError(f"{cmd[:3]} did not finish within {timeout:g}s (stopped)") from None
    finally:
        sampler.join(5)  # it ends within one sample once the process is gone
    if code:
        raise RuntimeError(f"{cmd[:3]} exited with {code}")
    measured.seconds = time.perf_counter() - started
    return measured


@dataclass
class Window:
    """A run's timed window in Unix seconds, the samples trained inside it, the checkpoints as (seconds into the
    window, model directory), and what is left out of it (TRL's checkpoint writes: wall and CPU seconds)."""

    start: float
    end: float
    samples: int
    checkpoints: list[tuple[float, str]]
    excluded_seconds: float = 0.0
    excluded_cpu_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start - self.excluded_seconds

    def cpu_seconds(self, measured: Measured) -> float:
        return max(0.0, measured.cpu_between(self.start, self.end) - self.excluded_cpu_seconds)


def trl_window(result: dict) -> Window:
    """From bench/trl_job.py's result.json: the window opens at the first generation and closes at the last step's
    end; a checkpoint's time leaves out the checkpoint writes before it."""
    start, ends, saves = result["window_start"], result["step_ends"], result.get("saves", [])
    if not ends:
        raise ValueError("TRL's result.json: no optimizer step recorded")
    out_dir = pathlib.Path(result["model_dir"]).parent
    checkpoints = []
    for save in saves:
        before = sum(s["wall_seconds"] for s in saves if s["step"] < save["step"])
        checkpoints.append((ends[save["step"] - 1] - start - before, str(out_dir / "checkpoints" /
                                                                         f"step-{save['step']}")))
    excluded = sum(s["wall_seconds"] for s in saves)
    checkpoints.append((ends[-1] - start - excluded, result["model_dir"]))
    return Window(start, ends[-1], result["samples"], checkpoints, excluded,
                  sum(s["cpu_seconds"] for s in saves))


def meshrl_window(records: list[dict], run_dir: pathlib.Path) -> Window:
    """From a run's metrics.jsonl: the builder issues its first training prompts when its version-0 evaluation ends
    (the window's start) and the last TRAINED event is the last optimizer step; a checkpoint counts from its
    version's TRAINED event (its weights exist then)."""
    evals = [r for r in records if r["kind"] == "eval" and r["version"] == 0]
    trained = sorted((r for r in records if r["kind"] == "trained"), key=lambda r: r["version"])
    if not evals or not trained:
        raise ValueError(f"{run_dir}/metrics.jsonl: needs the version-0 eval and a TRAINED event")
    start = min(r["at"] for r in evals)
    checkpoints = [(r["at"] - start, str(run_dir / "checkpoints" / f"v{r['version']}")) for r in trained[:-1]
                   if (run_dir / "checkpoints" / f"v{r['version']}").is_dir()]
    checkpoints.append((trained[-1]["at"] - start, str(run_dir / "final")))
    return Window(start, trained[-1]["at"], int(trained[-1].get("trajectories_trained", 0)), checkpoints)


def time_to_accuracy(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds into the window of the first point of (seconds, held-out accuracy) `curve` at or above `target`;
    None when the run never got there."""
    return next((seconds for seconds, accuracy in sorted(curve) if accuracy >= target - 1e-9), None)


def median_spread(values: list[float | None]) -> tuple[float | None, list[float | None]]:
    """(median, [min, max]) where a missing value (never reached) counts as infinitely slow; the median is None
    when it falls on a missing value."""
    if not values:
        return None, [None, None]
    ordered = sorted(float("inf") if v is None else v for v in values)
    mid = statistics.median(ordered)
    show = [None if v == float("inf") else round(v, 4) for v in (ordered[0], ordered[-1])]
    return (None if mid == float("inf") else round(mid, 4)), show
