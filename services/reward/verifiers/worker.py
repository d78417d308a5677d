"""A verifier worker process: reads ["load", verifier] and ["score", verifier, response, task] frames on stdin,
answers [status, ...] on stdout (status: "ok", "invalid" for a task the verifier refuses, "error").

Run by `pool.VerifierPool` as `python -m services.reward.verifiers.worker`; the pool kills it when a
verification passes its deadline. Frames: a 4-byte big-endian length, then msgpack. Anything the verifier
libraries print goes to stderr (stdout carries only frames).
"""

from __future__ import annotations

import os
import struct
import sys
from typing import BinaryIO

import msgpack

HEADER = struct.Struct(">I")


def write_frame(out: BinaryIO, value: object) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    out.write(HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> object | None:
    head = inp.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    data = inp.read(size)
    if len(data) < size:
        return None
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def main() -> None:
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the frames
    proto_in = sys.stdin.buffer
    from services.reward.verifiers import build_verifier  # the heavy imports happen once, before "ready"

    verifiers = {"math": build_verifier("math")}
    write_frame(proto_out, ["ready"])
    while (request := read_frame(proto_in)) is not None:
        kind, name = request[0], request[1]
        try:
            if name not in verifiers:
                verifiers[name] = build_verifier(name)
                getattr(verifiers[name], "warm", lambda: None)()
            if kind == "load":
                reply = ["ok"]
            else:
                verdict = verifiers[name].score(request[2], request[3])
                reply = ["ok", float(verdict.reward), verdict.detail,
                         [[int(step.end), float(step.reward)] for step in verdict.steps]]
        except ValueError as exc:
            reply = ["invalid", str(exc)]
        except Exception as exc:  # noqa: BLE001 - the verifier library failed on this input: the parent scores 0
            reply = ["error", f"{type(exc).__name__}: {exc}"]
        write_frame(proto_out, reply)

if __name__ == "__main__":
    main()
