"""The memory planner (services.trainer.plan) against the measured peak of real CPU training steps.

Each case runs in a fresh process: import everything, read the resident set (the baseline), build a
``TrainerEngine`` (torch backend, GRPO) on a model directory, run steps on a padded batch of ``rows`` x
``seq_len`` tokens, and read the peak resident set of the steady-state step (the second: the optimizer state
exists and the first update's gradients are held through the forward). measured = peak - baseline. Before the
baseline, one step on a throwaway 30k-parameter model of the same kind runs, so that the code pages and
allocator arenas a step touches (~30 MB of libtorch, not tensors) are in the baseline, not in the measurement.

Why the resident set: it is what the kernel charges the process, allocator overheads included, with no
instrumentation in the step. Two things make it follow the live tensors: the peak counter (VmHWM) is reset
right before the measured step (writing 5 to /proc/self/clear_refs), and glibc's mmap threshold is pinned at
64 KiB (MALLOC_MMAP_THRESHOLD_), so every tensor above that is its own mapping, handed back to the kernel when
freed; with the default dynamic threshold, freed blocks up to 32 MiB stay in the heap and a later, larger
peak could hide in them. Parameters mapped from safetensors count once the forward touches them.

    python -m bench.memory_peaks [--model DIR] [--tokens 512,2048] [--seq-len 256] [--dtype float32]

Prints a table (predicted, measured, error) and one JSON line per case.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@dataclasses.dataclass(frozen=True)
class Case:
    model_dir: str
    rows: int
    seq_len: int
    dtype: str = "float32"
    lora_rank: int = 0
    ranks: int = 1          # > 1: the fsdp2 backend over that many gloo ranks, each its own process
    steps: int = 2
    megatron: str = ""      # "tp=2" / "pp=2" / ...: the megatron backend over `ranks` gloo ranks instead

    @property
    def backend(self) -> str:
        return "megatron" if self.megatron else "fsdp2" if self.ranks > 1 else "torch"

    def sizes(self) -> dict[str, int]:
        return {k: int(v) for k, v in (part.split("=") for part in self.megatron.split(",") if part)}

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


def build_model(path: str | pathlib.Path, *, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 64, intermediate: int = 768, vocab: int = 8192, seed: int = 0, experts: int = 0) -> str:
    """A float32 Qwen3 (a Qwen3-MoE with `experts`) with the tiny model's tokenizer (ids past it are still valid
    model inputs)."""
    import torch

    from services.trainer.models import TinyQwen3Config, build_tokenizer

    torch.manual_seed(seed)
    model = TinyQwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                            max_position_embeddings=4096, num_experts=experts).build(vocab)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def can_measure() -> bool:
    """Linux with a resettable peak resident set (/proc/self/clear_refs)."""
    return os.access("/proc/self/clear_refs", os.W_OK) and os.path.exists("/proc/self/status")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(key)


def _batch(rows: int, seq_len: int, vocab: int):
    """rows x seq_len tokens; the last row is one token short, so the batch is padded like a real one."""
    import torch

    from services.common.contracts import data_pb2
    from services.trainer.batching import pack

    g = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(rows):
        n = seq_len - (1 if i == rows - 1 and rows > 1 else 0)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        prompt, completion = ids[:4], ids[4:]
        trajectories.append(data_pb2.Trajectory(
            trajectory_id=f"t{i}", group_id=f"g{i // 2}", prompt_ids=prompt, completion_ids=completion,
            behavior_logprobs=[-8.0] * len(completion), versions=[0] * len(completion),
            loss_mask=[1] * len(completion), reward=float(i % 2), finish_reason="stop"))
    return pack(trajectories, 0)


def child(case: Case) -> dict[str, float]:
    """In the measuring process (one rank of a case): baseline, engine, steps; bytes."""
    import torch
    import torch.distributed as dist

    from services.trainer.config import MegatronConfig, TrainerConfig
    from services.trainer.engine import build_engine
    from services.trainer.lora import LoraConfig
    from services.trainer.optim import OptimConfig
    from services.trainer.packing import PackingConfig

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    # before the group exists: with one, save_pretrained writes on rank 0 only
    config = json.loads(pathlib.Path(case.model_dir, "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    warm = build_model(f"{tmp.name}/warm", hidden=32, layers=2, heads=2, kv_heads=2, head_dim=16, intermediate=64,
                       vocab=512, experts=experts)   # a MoE warm-up for a MoE case: ep needs experts
    if case.ranks > 1:  # joined here, so the engines join it and leave it up (the warm-up's close keeps it)
        dist.init_process_group("gloo", init_method="env://")

    def engine_for(model_dir: str):
        megatron = {"megatron": MegatronConfig(**case.sizes()), "packing": PackingConfig(enabled=False),
                    "run_dir": tmp.name} if case.megatron else {}
        return build_engine(TrainerConfig(
            model_path=model_dir, algo="grpo", max_new_tokens=case.seq_len, wx_address="", dtype=case.dtype,
            optim=OptimConfig(lr=1e-5), lora=LoraConfig(enabled=case.lora_rank > 0, r=max(1, case.lora_rank)),
            backend=case.backend, ranks=case.ranks, **megatron))

    warm_engine = engine_for(warm)  # the same code paths once, so their pages are in the baseline
    warm_engine.step(_batch(2 * case.ranks, 16, 512), version=0)
    warm_engine.close()
    del warm_engine
    gc.collect()
    config = json.loads((pathlib.Path(case.model_dir) / "config.json").read_text())
    batch = _batch(case.rows, case.seq_len, int(config["vocab_size"]))
    baseline = _status("VmRSS")
    engine = engine_for(case.model_dir)
    out = {"baseline": baseline, "after_load": _status("VmRSS") - baseline}
    for step in range(case.steps):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        engine.step(batch, version=step)
        out[f"step{step}_peak"] = _status("VmHWM") - baseline
        out[f"step{step}_after"] = _status("VmRSS") - baseline
    out["measured"] = max(out[f"step{s}_peak"] for s in range(case.steps))
    engine.close()
    tmp.cleanup()
    if case.ranks > 1:
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(case: Case, timeout: float = 900.0) -> list[dict[str, float]]:
    """Run ``case`` in fresh processes (allocator settings fixed at their start), one per rank."""
    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1"}
    if case.ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(case.ranks))
    root = pathlib.Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "bench.memory_peaks", "--child", json.dumps(dataclasses.asdict(case))]
    procs = [subprocess.Popen(command, cwd=root, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}
                              if case.ranks > 1 else env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(case.ranks)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # nothing outlives a failed case, even a rank stuck in a collective
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [f"rank {r} (exit {p.returncode}):\n{err[-2000:]}"
              for r, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)) if p.returncode]
    if failed:
        raise RuntimeError(f"measuring {case} failed:\n" + "\n".join(failed))
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def predict(case: Case) -> list[int]:
    """The planner's peak for each rank; data-parallel ranks each forward their share of the rows (megatron:
    tp and pp ranks forward the same rows; pp > 1 in 2 x pp microbatches)."""
    from services.trainer.config import MegatronConfig
    from services.trainer.plan import PlanConfig, load_model, plan

    backend, dp, tokens = case.backend, case.ranks, case.tokens // case.ranks
    if case.megatron:
        megatron = MegatronConfig(**case.sizes())
        dp = megatron.dp(case.ranks)
        backend = f"megatron:{case.megatron}"
        micro = megatron.pipeline_microbatches if megatron.pp > 1 else 1   # rows padded up to equal microbatches
        tokens = -(-case.rows // dp // micro) * case.seq_len
    config = PlanConfig(backend=backend, dp=dp, micro_batch_tokens=tokens, seq_len=case.seq_len, dtype=case.dtype,
                        lora_rank=case.lora_rank, device="cpu")
    return [r.total for r in plan(load_model(case.model_dir), config).ranks]


def compare(case: Case) -> list[dict[str, float]]:
    """One row per rank: predicted and measured peak, error = predicted / measured - 1."""
    rows = []
    for rank, (measured, predicted) in enumerate(zip(measure(case), predict(case), strict=True)):
        rows.append({"model": pathlib.Path(case.model_dir).name, "backend": case.backend + (f":{case.megatron}" if case.megatron else ""),
                     "rank": rank, "tokens": case.tokens, "rows": case.rows, "seq_len": case.seq_len,
                     "dtype": case.dtype, "lora_rank": case.lora_rank, "predicted_mib": predicted / 2**20,
                     "measured_mib": measured["measured"] / 2**20, "error": predicted / measured["measured"] - 1,
                     "raw": measured})
    return rows


def compare_all(cases: list[Case], parallel: int = 2) -> list[dict[str, float]]:
    """``compare`` each case, ``parallel`` cases at a time (each process measures only itself)."""
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        return [row for rows in pool.map(compare, cases) for row in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_peaks", description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help="a model directory (default: a 5M-parameter Qwen3 built here)")
    p.add_argument("--tokens", default="512,2048", help="tokens per batch (fsdp2: split over the ranks)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1, help="> 1: the fsdp2 backend over this many ranks")
    p.add_argument("--megatron", default="", help="the megatron backend at these sizes over --ranks (e.g. tp=2)")
    p.add_argument("--parallel", type=int, default=1, help="cases measured at once")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(Case(**json.loads(args.child)))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_model(pathlib.Path(tmp) / "qwen3-5m")
        tokens = [int(t) for t in args.tokens.split(",")]
        if any(t % args.seq_len for t in tokens):
            raise ValueError(f"tokens: each must be a multiple of --seq-len {args.seq_len}, got {tokens}")
        rows = compare_all([Case(model_dir, t // args.seq_len, args.seq_len, args.dtype, args.lora_rank, args.ranks,
                                 megatron=args.megatron) for t in tokens], args.parallel)
    print(f"{'model':<12} {'backend':<14} {'rank':>4} {'dtype':<9} {'lora':>4} {'tokens':>7} {'seq_len':>7} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}")
    for r in rows:
        print(f"{r['model']:<12} {r['backend']:<14} {r['rank']:>4} {r['dtype']:<9} {r['lora_rank']:>4} {r['tokens']:>7} {r['seq_len']:>7} {r['predicted_mib']:>14.1f} "
              f"{r['measured_mib']:>13.1f} {r['error']:>+7.1%}")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
