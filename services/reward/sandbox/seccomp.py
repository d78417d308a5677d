"""The seccomp filter a judged program runs under (bwrap --seccomp FD, installed after bwrap's own setup).

Namespaces and rlimits keep a program away from the host's files, processes and network; this filter keeps it
away from the kernel's largest and least needed surfaces, which matters most where the reward container itself
runs without the container engine's seccomp profile (bubblewrap needs unshare and mount, which that profile denies).
A deny list, not an allow list: interpreters, compilers and test runners use a wide and changing set of ordinary
syscalls, and none of these. A denied call fails with EPERM, as it would for an unprivileged user.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

DENIED = (
    # loading code into the kernel, rebooting it, changing the machine's time, swap, accounting, quotas, the log
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "uselib",
    "lookup_dcookie", "vhangup", "nfsservctl",
    # more namespaces and mounts: the sandbox made the program's own; it may make no others
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr",
    # other processes' memory, and tracing
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel surfaces behind most local privilege escalations, which no judged program needs
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "open_by_handle_at", "name_to_handle_at", "fanotify_init",
)


SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO = 0x00050000  # | errno


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing here (Debian's libseccomp2)."""


@functools.cache
def filter_program() -> bytes:
    """The compiled BPF program for this machine's architecture (built once per process, by libseccomp: a call from
    another architecture's syscall table, such as i386's through int 0x80, kills the program, libseccomp's default)."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        for name in DENIED:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a syscall of this architecture (or too new for this libseccomp): nothing to deny
            rc = lib.seccomp_rule_add(ctx, SCMP_ACT_ERRNO | errno.EPERM, number, 0)
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")
        with os.fdopen(os.memfd_create("meshrl-seccomp", os.MFD_CLOEXEC), "w+b") as sink:
            rc = lib.seccomp_export_bpf(ctx, sink.fileno())
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            sink.seek(0)
            return sink.read()
    finally:
        lib.seccomp_release(ctx)


def _libseccomp() -> ctypes.CDLL:
    path = ctypes.util.find_library("seccomp")
    if path is None:
        raise SeccompUnavailable("libseccomp is not installed (Debian's libseccomp2)")
    lib = ctypes.CDLL(path, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.restype = ctypes.c_int
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def program_fd() -> int:
    """A fresh file descriptor holding the program, at offset 0, inheritable (bwrap reads it to its end): one per
    run, since runs at once would share one descriptor's offset. The caller closes it once the run started."""
    fd = os.memfd_create("meshrl-seccomp-run", 0)
    os.write(fd, filter_program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
