"""The aggregate bound of a run: one cgroup per slot, memory (tmpfs, SysV shm and memfd included: RLIMIT_AS covers
none of them, nor the sum over processes) and pids, for every process of the run together. The run's first process
joins its slot's cgroup before it execs anything (the `JOIN` wrapper), so nothing of the run starts outside it.

cgroup v2 where our own cgroup can hand memory and pids to children (a delegated cgroup, or the root of a cgroup
namespace), else v1's memory and pids hierarchies; neither (not root, nothing delegated): no aggregate bound, said
once at start-up (`Sandbox.aggregate_bound`). Slots are reused across runs (a cgroup per run would cost a mkdir and
an rmdir per run, and leave dying memory cgroups behind) and removed when the sandbox goes."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import itertools
import os
import re

MB = 1 << 20
PREFIX = "meshrl-sandbox-"
# run by the run's first process, as the service: join each cgroup (its pid into every cgroup.procs given before
# `--`), then exec the run. A failed join ends the run before it starts (exit JOIN_FAILED, JOIN_MARKER on stderr).
JOIN_FAILED = 125
JOIN_MARKER = "meshrl-sandbox: cannot join the run's cgroup"
JOIN = ('while [ "$1" != -- ]; do echo $$ > "$1" || { echo "' + JOIN_MARKER + ' $1" >&2; exit '
        + str(JOIN_FAILED) + '; }; shift; done; shift; exec "$@"')


_instances = itertools.count()  # several sandboxes of one process get distinct cgroups


class CgroupUnavailable(RuntimeError):
    """No cgroup here can bound a run; the message says why."""


@dataclasses.dataclass(frozen=True)
class Slot:
    dirs: tuple[str, ...]   # the slot's cgroup directories (one per v1 hierarchy, or one v2 cgroup)
    procs: tuple[str, ...]  # their cgroup.procs files, which the run's first process joins
    oom_file: str           # holds the "oom_kill N" counter

    def oom_kills(self) -> int:
        with contextlib.suppress(OSError):
            with open(self.oom_file) as f:
                return parse_oom_kills(f.read())
        return 0

    def wrap(self, argv: list[str]) -> list[str]:
        return ["/bin/sh", "-c", JOIN, "sh", *self.procs, "--", *argv]


def parse_oom_kills(text: str) -> int:
    match = re.search(r"^oom_kill (\d+)$", text, re.M)
    return int(match.group(1)) if match else 0


def parse_own_cgroups(text: str) -> dict[str, str]:
    """/proc/self/cgroup -> {controller: path}; cgroup v2's entry under ""."""
    own = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def parse_mounts(text: str) -> dict[str, tuple[str, str]]:
    """/proc/self/mountinfo -> {controller: (mount point, root in the hierarchy)}; cgroup v2's under ""."""
    mounts: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, (fstype, _source, options) = left.split(), right.split()[:3]
        root, point = fields[3], fields[4]
        if fstype == "cgroup2":
            mounts.setdefault("", (point, root))
        elif fstype == "cgroup":
            for controller in options.split(","):
                mounts.setdefault(controller, (point, root))
    return mounts


def located(mounts: dict[str, tuple[str, str]], own: dict[str, str], controller: str) -> str | None:
    """The directory of our own cgroup in `controller`'s hierarchy, if it is mounted here."""
    if controller not in mounts or controller not in own:
        return None
    point, root = mounts[controller]
    path = own[controller]
    if root != "/" and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return os.path.join(point, path.lstrip("/"))


class Cgroups:
    """The slots' cgroups, created with their limits (CgroupUnavailable when no cgroup can be made here)."""

    def __init__(self, where: str, slots: int, memory_bytes: int, pids: int) -> None:
        self.memory_bytes, self.pids = memory_bytes, pids
        self.slots: list[Slot] = []
        self.version, parents = self._parents(where)
        self.description = (f"cgroup {self.version} per slot: memory {memory_bytes // MB} MiB, pids {pids}, for all "
                            f"of a run's processes together")
        for parent in parents:
            _remove_stale(parent)
        instance = next(_instances)
        try:
            for n in range(slots):
                self.slots.append(self._make(parents, f"{PREFIX}{os.getpid()}-{instance}-{n}"))
        except OSError as exc:
            self.close()
            raise CgroupUnavailable(f"cannot create a slot's cgroup under {', '.join(parents)}: {exc}") from exc

    def close(self) -> None:
        for slot in self.slots:
            for path in slot.dirs:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        self.slots = []

    def _parents(self, where: str) -> tuple[str, list[str]]:
        if where not in ("auto", ""):
            _enable_v2(where)  # a delegated v2 cgroup, named in the config
            return "v2", [where]
        with open("/proc/self/mountinfo") as f:
            mounts = parse_mounts(f.read())
        with open("/proc/self/cgroup") as f:
            own = parse_own_cgroups(f.read())
        errors = []
        v2 = located(mounts, own, "")
        if v2:
            try:
                _enable_v2(v2)
                return "v2", [v2]
            except CgroupUnavailable as exc:
                errors.append(str(exc))
        v1 = [located(mounts, own, c) for c in ("memory", "pids")]
        if all(v1) and all(os.access(p, os.W_OK) for p in v1):
            return "v1", [p for p in v1 if p]
        errors.append(f"cgroup v1: memory and pids hierarchies {'not writable' if all(v1) else 'not mounted'}")
        raise CgroupUnavailable("; ".join(errors))

    def _make(self, parents: list[str], name: str) -> Slot:
        dirs = tuple(os.path.join(p, name) for p in parents)
        for path in dirs:
            with contextlib.suppress(FileExistsError):  # left by a process of our pid before (pid reuse)
                os.mkdir(path)
        if self.version == "v2":
            (cg,) = dirs
            _write(cg, "memory.max", self.memory_bytes)
            _write(cg, "memory.swap.max", 0, optional=True)
            _write(cg, "memory.oom.group", 1, optional=True)  # an OOM kill ends the whole run
            _write(cg, "pids.max", self.pids)
            return Slot(dirs, (os.path.join(cg, "cgroup.procs"),), os.path.join(cg, "memory.events"))
        memory, pids = dirs
        _write(memory, "memory.limit_in_bytes", self.memory_bytes)
        _write(memory, "memory.memsw.limit_in_bytes", self.memory_bytes, optional=True)  # swap too, where accounted
        _write(pids, "pids.max", self.pids)
        return Slot(dirs, tuple(os.path.join(d, "cgroup.procs") for d in dirs), os.path.join(memory, "memory.oom_control"))


def _enable_v2(path: str) -> None:
    """Hand memory and pids to `path`'s children (fails in a non-root cgroup that holds processes itself)."""
    try:
        with open(os.path.join(path, "cgroup.controllers")) as f:
            available = f.read().split()
        missing = [c for c in ("memory", "pids") if c not in available]
        if missing:
            raise CgroupUnavailable(f"cgroup v2 {path}: no {' or '.join(missing)} controller")
        with open(os.path.join(path, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        if not {"memory", "pids"} <= set(enabled):
            _write(path, "cgroup.subtree_control", "+memory +pids")
    except OSError as exc:
        raise CgroupUnavailable(f"cgroup v2 {path}: cannot enable memory and pids for children: {exc}") from exc


def _write(cg: str, name: str, value: object, optional: bool = False) -> None:
    path = os.path.join(cg, name)
    if optional and not os.path.exists(path):
        return
    with open(path, "w") as f:
        f.write(str(value))


def _remove_stale(parent: str) -> None:
    """Slot cgroups of sandbox processes that are gone (rmdir fails on one still in use, which is fine)."""
    for path in glob.glob(os.path.join(parent, PREFIX + "*-*")):
        pid = os.path.basename(path)[len(PREFIX):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.rmdir(path)
