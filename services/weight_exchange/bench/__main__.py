"""`python -m services.weight_exchange.bench --src megatron:tp=4,pp=2,ep=8 --dst vllm:tp=4,dp=2
--model qwen3-30b-a3b [--simulate] [--transport shm|tcp|gloo|ucx]`: one JSON line per measured case.

--model: a built-in name or a Hugging Face config.json path (or a directory holding one). Without
--simulate every rank runs as a process on this machine with real tensors (mind the memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from services.weight_exchange.bench.runner import Case, run_case
from services.weight_exchange.bench.simulate import simulate
from services.weight_exchange.client.transports import KNOWN


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.weight_exchange.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="sender side, e.g. megatron:tp=4,pp=2,ep=8,dp=2 | fsdp2:dp=4 | hf")
    ap.add_argument("--dst", required=True, help="receiver side, e.g. vllm:tp=4,dp=2 | sglang:tp=8,ep=4 | embedded")
    ap.add_argument("--model", required=True, help="built-in name or path to a Hugging Face config.json")
    ap.add_argument("--simulate", action="store_true", help="shapes only: plan statistics and modeled seconds")
    ap.add_argument("--transport", action="append", choices=sorted(KNOWN),
                    help="transport(s) to measure (repeatable; default shm and tcp)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--link-gbps", type=float, default=50.0, help="per-rank link bandwidth for --simulate (GB/s)")
    ap.add_argument("--log-dir", default="/tmp/meshrl-bench-weights")
    a = ap.parse_args(argv)
    try:
        if a.simulate:
            print(json.dumps(simulate(a.model, a.src, a.dst, link_gbps=a.link_gbps, dtype=a.dtype,
                                      bucket_bytes=a.bucket_mb << 20)), flush=True)
            return
        case = Case(f"{a.model}:{a.src}->{a.dst}", a.model, a.src, a.dst, tuple(a.transport or ("shm", "tcp")),
                    a.dtype, a.repeat, a.bucket_mb << 20)
        for line in asyncio.run(run_case(case, a.log_dir)):
            print(json.dumps(line), flush=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main()
