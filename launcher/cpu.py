"""CPU-seconds per process tree, read from /proc (Linux): what each service of a run spent, its own children
included (verifier workers, sandboxed programs, trainer ranks it started). Elsewhere: nothing (None)."""

from __future__ import annotations

import os
import pathlib

PROC = pathlib.Path("/proc")
CPU_LOG = "cpu_steps.jsonl"  # in the run directory: one line per trained step (launcher.watch.sample_cpu)
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU-seconds of the process and of its children it has waited for)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of the man page
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / TICKS


def tree_cpu_seconds(pids: dict[str, int]) -> dict[str, float] | None:
    """Per name, the CPU-seconds of that pid and of every live descendant (exited ones are in their parent's
    waited-for children's time). None where /proc is not there."""
    if not (PROC / "self" / "stat").exists():
        return None
    table = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                table[int(entry.name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for name, root in pids.items():
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            if pid in table:
                total += table[pid][1]
                todo.extend(children.get(pid, []))
        out[name] = round(total, 2)
    return out


# which part of the system a process belongs to: the message plane is what moves and scores data between the
# engine and the trainer (reward, builder, NATS); the rollout's own publishing is inside "rollout"
ROLES = {"trainer": "trainer", "rollout": "rollout", "reward": "message plane", "builder": "message plane",
         "weight_exchange": "weight exchange"}


def role_of(process: str) -> str:
    if process.startswith("trainer-rank"):
        return "trainer"
    if process.startswith("nats"):
        return "message plane"
    return ROLES.get(process, process)


def per_step(samples: list[dict]) -> list[dict]:
    """CPU-seconds each process spent between consecutive samples ({"version", "cpu": {process: cumulative}}, one
    per trained step), as {"version", "cpu": {process: seconds}}. A process whose total went down was restarted: its
    new total is what it spent. The first sample's totals include start-up and are not a step's."""
    out = []
    for before, after in zip(samples, samples[1:], strict=False):
        spent = {}
        for name, total in after["cpu"].items():
            previous = before["cpu"].get(name, 0.0)
            spent[name] = round(total - previous if total >= previous else total, 3)
        out.append({"version": after["version"], "cpu": spent})
    return out


def shares(steps: list[dict]) -> dict:
    """Mean CPU-seconds per step by role, and each role's share of all of it."""
    totals: dict[str, float] = {}
    for step in steps:
        for name, seconds in step["cpu"].items():
            totals[role_of(name)] = totals.get(role_of(name), 0.0) + seconds
    whole = sum(totals.values())
    return {"cpu_seconds_per_step": {r: round(s / len(steps), 3) for r, s in sorted(totals.items())} if steps else {},
            "cpu_share": {r: round(s / whole, 3) for r, s in sorted(totals.items())} if whole else {}}
