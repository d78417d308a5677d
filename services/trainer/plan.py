"""Pre-flight memory planner: each trainer rank's predicted peak memory (parameters, gradients, optimizer state,
activations, weight-sync buffers) and whether it fits the device, from the model's config.json alone.

    python -m services.trainer.plan --model DIR --backend megatron:tp=4,pp=1,ep=1 --dp 2 \
        --micro-batch-tokens 4096 --dtype bfloat16 --device-memory 80GiB

Formulas: services/trainer/planning/; calibration against measured CPU peaks: bench/memory_peaks.py.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from services.common.errors import FieldError
from services.trainer.planning.memory import CATEGORIES, Plan, PlanConfig, RankPlan, plan
from services.trainer.planning.model import PlannedModel, load_model

__all__ = ["Plan", "PlanConfig", "RankPlan", "load_model", "main", "parse_bytes", "plan", "render"]

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str, field: str = "device_memory") -> int:
    """'80GiB', '141GB', '512MiB', '1000000' -> bytes; ValueError naming ``field``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise FieldError(field, f"expected a size such as 80GiB or 141GB, got {text!r}")
    value = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if value <= 0:
        raise FieldError(field, f"must be positive, got {text!r}")
    return value


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def render(result: Plan) -> str:
    """One row per distinct breakdown (ranks with identical shares are listed together), then the verdict."""
    groups: dict[tuple, list[RankPlan]] = {}
    for r in result.ranks:
        groups.setdefault(tuple(r.breakdown().values()), []).append(r)
    head = ["ranks", *CATEGORIES, "total"]
    rows = [head]
    for members in groups.values():
        first = members[0]
        label = ",".join(str(r.rank) for r in members[:8]) + ("…" if len(members) > 8 else "")
        if len(result.ranks) > 1 and len(members) == 1:
            label += f" ({first.what})"
        rows.append([label, *(human(v) for v in first.breakdown().values())])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(widths[i]) if i else cell.ljust(widths[i]) for i, cell in enumerate(row))
             for row in rows]
    peak = result.peak
    detail = ", ".join(f"{k} {human(v)}" for k, v in peak.detail.items())
    lines += ["", f"peak rank {peak.rank} detail: {detail}"]
    verdict = "FITS" if result.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: peak {human(peak.total)} on rank {peak.rank} vs {human(result.config.device_memory)} "
                 f"device memory (margin {human(result.margin)})")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def as_json(result: Plan, model: PlannedModel) -> dict:
    return {"model": model.spec.__dict__ | {"mlp_only_layers": list(model.spec.mlp_only_layers)},
            "config": result.config.__dict__,
            "ranks": [{"rank": r.rank, "what": r.what, **r.breakdown(), "detail": r.detail} for r in result.ranks],
            "peak_rank": result.peak.rank, "peak_bytes": result.peak.total, "fits": result.fits,
            "margin_bytes": result.margin, "notes": result.notes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.trainer.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory (or its config.json)")
    p.add_argument("--backend", default="torch", help="torch | fsdp2 | megatron:tp=..,pp=..,ep=..[,etp=..]")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (fsdp2: the ranks)")
    p.add_argument("--micro-batch-tokens", type=int, required=True, help="tokens in one forward on one rank")
    p.add_argument("--seq-len", type=int, default=0, help="padded row length (default: one row)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cpu | cuda | npu")
    p.add_argument("--device-memory", default="80GiB")
    p.add_argument("--weight-transport", default="shm", help="shm | tcp")
    p.add_argument("--json", action="store_true", help="the whole plan as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model = load_model(args.model)
        config = PlanConfig(backend=args.backend, dp=args.dp, micro_batch_tokens=args.micro_batch_tokens,
                            seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer,
                            lora_rank=args.lora_rank, device=args.device,
                            device_memory=parse_bytes(args.device_memory), weight_transport=args.weight_transport)
        result = plan(model, config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(result, model), indent=2) if args.json else render(result))
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
