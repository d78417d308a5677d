"""The command line of one sandboxed run: prlimit (rlimits, inherited by everything below) -> bwrap (namespaces,
mounts, environment) -> prlimit (nproc, counted in the run's own user namespace) -> the program."""

from __future__ import annotations

import os
import shutil

from services.reward.sandbox.config import SandboxConfig
from services.reward.sandbox.languages import Language

SOURCE_DIR = "/sandbox"   # the program, read-only
WORK_DIR = "/tmp"         # private tmpfs, the only writable place; also HOME and the working directory
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "TMPDIR": WORK_DIR, "LANG": "C.UTF-8"}
MB = 1 << 20


def system_mounts() -> list[str]:
    """/usr read-only, and the top-level links into it (merged /usr) or read-only binds where they are dirs. Nothing
    else of the host: no /etc, /root, /home, /work, /run, /var."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def interpreter_mounts(interpreter: str) -> list[str]:
    real = os.path.realpath(interpreter)
    if real.startswith("/usr/"):
        return []
    prefix = os.path.dirname(os.path.dirname(real))  # <prefix>/bin/python3
    return ["--ro-bind", prefix, prefix]


def command(config: SandboxConfig, lang: Language, program: str | None, argv: list[str] | None = None,
            seccomp_fd: int | None = None) -> list[str]:
    """`program`: the host path of the source file (bound read-only into SOURCE_DIR); `argv`: run this instead of
    the language's command (the start-up check runs `true`); `seccomp_fd`: a descriptor holding the seccomp
    program bwrap installs last, just before the program starts (inherited by the run's first process)."""
    limits = config.limits
    prlimit = shutil.which("prlimit") or "/usr/bin/prlimit"
    outer = [prlimit, f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb * MB}",
             f"--fsize={limits.fsize_mb * MB}", f"--nofile={limits.nofile}", "--core=0", "--"]
    # RLIMIT_NPROC is set inside, by the run's pid 1: there the kernel counts it per user namespace and uid, so only
    # this run's processes count (since Linux 5.14). Set outside, it would count every process of the uid: as a
    # non-root service that is the service's own threads too, and bwrap itself could not start.
    inner = [prlimit, f"--nproc={limits.nproc}", "--"]
    # --as-pid-1 so bwrap waits on pid 1 itself: its own pid-1 helper is left a zombie for the host's init to reap,
    # counting against the uid's RLIMIT_NPROC meanwhile. /bin/sh is pid 1 instead, so the program keeps the
    # ordinary signal semantics of a pid other than 1 (SIGXCPU, kill from inside); its exit ends the namespace.
    bwrap = [config.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
             "--new-session", "--as-pid-1", "--hostname", "sandbox", *system_mounts(), *interpreter_mounts(config.python),
             "--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_mb * MB), "--tmpfs", WORK_DIR]
    inside = f"{SOURCE_DIR}/{lang.filename}"
    if program is not None:
        bwrap += ["--ro-bind", program, inside]
    # the root and /dev are bwrap's own tmpfs mounts, with no size limit: read-only, so /tmp is the only place to write
    bwrap += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR, "--clearenv"]
    if seccomp_fd is not None:
        bwrap += ["--seccomp", str(seccomp_fd)]
    for key, value in ENV.items():
        bwrap += ["--setenv", key, value]
    return [*outer, *bwrap, "--", *inner, "/bin/sh", "-c", '"$@"', "sh", *(argv or lang.command(config.python, inside))]
