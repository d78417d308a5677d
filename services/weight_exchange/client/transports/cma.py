"""Cross-memory attach (Linux `process_vm_readv`): a receiver copies straight from a sender's parameter memory
into its own live tensors, one copy and no staging. Needs the same host and ptrace permission over the sender
(same user, Yama ptrace_scope 0, or CAP_SYS_PTRACE); the shm transport falls back to its ring otherwise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Iterator, Sequence

import torch

IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = None


def _readv():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                           ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        _libc.process_vm_readv.restype = ctypes.c_ssize_t
    return _libc.process_vm_readv


class CmaUnavailable(OSError):
    """process_vm_readv is not permitted or not implemented here."""


def describe(t: torch.Tensor) -> list:
    """What a peer needs to read a (possibly strided) CPU tensor view: address, shape, strides, itemsize."""
    return [t.data_ptr(), list(t.shape), list(t.stride()), t.element_size()]


def runs(ptr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> list[tuple[int, int]]:
    """The contiguous (address, bytes) runs of a strided view, in row-major order."""
    if any(s == 0 for s in shape):
        return []
    k, expected = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expected):
        expected *= shape[k - 1]
        k -= 1
    run = expected * itemsize
    if k == 0:
        return [(ptr, run)]
    offsets = torch.zeros((), dtype=torch.int64)
    for d in range(k):
        offsets = offsets.unsqueeze(-1) + torch.arange(shape[d], dtype=torch.int64) * strides[d]
    return [(ptr + int(o) * itemsize, run) for o in offsets.reshape(-1).tolist()]


def _pieces(remote: list[tuple[int, int]], local: list[tuple[int, int]]) -> Iterator[tuple[list, list]]:
    """Pair remote and local runs into batches of at most IOV_MAX equal-length pieces."""
    i = j = ro = lo = 0
    while i < len(remote):
        rb, lb = [], []
        while i < len(remote) and len(rb) < IOV_MAX:
            (ra, rl), (la, ll) = remote[i], local[j]
            n = min(rl - ro, ll - lo)
            rb.append((ra + ro, n))
            lb.append((la + lo, n))
            ro, lo = ro + n, lo + n
            if ro == rl:
                i, ro = i + 1, 0
            if lo == ll:
                j, lo = j + 1, 0
        yield rb, lb


def read(pid: int, remote: list[tuple[int, int]], local: list[tuple[int, int]]) -> None:
    """Copy the remote runs of process `pid` into the local runs (same total length)."""
    readv = _readv()
    for rb, lb in _pieces(remote, local):
        riov = (_Iovec * len(rb))(*[_Iovec(a, n) for a, n in rb])
        liov = (_Iovec * len(lb))(*[_Iovec(a, n) for a, n in lb])
        want = sum(n for _, n in rb)
        got = readv(pid, liov, len(lb), riov, len(rb), 0)
        if got != want:
            err = ctypes.get_errno()
            if got < 0 and err in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                raise CmaUnavailable(err, f"process_vm_readv: {os.strerror(err)}")
            raise OSError(err, f"process_vm_readv read {got} of {want} bytes: {os.strerror(err)}")
