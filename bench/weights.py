"""`make bench-weights`: the weight-exchange benchmark, one JSON line per case.

Measured here (every rank a process, the service in this process): a ~1.2 GB bf16 dense model with
Qwen3-0.6B shapes, Megatron TP2 -> vLLM-layout TP2 (four processes), over shm (cross-memory attach), shm-ring
(the /dev/shm ring, no cross-memory attach), tcp, gloo and ucx (when ucxx is installed), each beside
the naive gather-then-send-everything plan over the same transport. Then the paper-scale simulation
(shapes only) for Qwen3-30B-A3B and Qwen3-235B-A22B.

    python -m bench.weights [--quick] [--no-simulate]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
from unittest import mock

from services.common.logging import configure_logging
from services.weight_exchange.bench.runner import Case, run_case
from services.weight_exchange.bench.simulate import SCENARIOS, simulate


def cases(quick: bool) -> list[tuple[Case, dict[str, str]]]:
    model = "tiny-qwen3" if quick else "qwen3-0.6b"
    transports = ("shm", "shm-ring", "tcp", "gloo") + (("ucx",) if importlib.util.find_spec("ucxx") else ())
    repeat = 1 if quick else 3
    name = "quick-tiny" if quick else "dense-1gb"
    return [(Case(f"{name}-megatron-tp2-to-vllm-tp2", model, "megatron:tp=2", "vllm:tp=2", transports,
                  repeat=repeat), {})]


async def measure(quick: bool) -> None:
    for case, env in cases(quick):
        with mock.patch.dict(os.environ, env):
            for line in await run_case(case, "/tmp/meshrl-bench-weights"):
                print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, one round (smoke test)")
    ap.add_argument("--no-simulate", action="store_true")
    a = ap.parse_args()
    configure_logging("bench", "warning")  # stdout carries only the JSON lines; logs go to stderr
    asyncio.run(measure(a.quick))
    if not a.no_simulate:
        for model, src, dst in SCENARIOS[:1] if a.quick else SCENARIOS:
            print(json.dumps(simulate(model, src, dst)), flush=True)


if __name__ == "__main__":
    main()
