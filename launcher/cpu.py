"""CPU-seconds per process tree, read from /proc (Linux): what each service of a run spent, its own children
included (verifier workers, sandboxed programs, trainer ranks it started). Elsewhere: nothing (None)."""

from __future__ import annotations

import os
import pathlib

PROC = pathlib.Path("/proc")
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
