"""One rank of a megatron-core check on CPU (gloo, use_cpu_initialization, a file:// rendezvous).

`python -m tests.trainer.megatron_rank --mode convert --rank R --world W --store FILE --out DIR --model NAME
 --side megatron:tp=2,...`: builds this rank's GPTModel, loads the HF -> Megatron conversion of
`random_canonical(spec)` with strict=True, and writes DIR/rank<R>.safetensors (the live state read back) and
DIR/rank<R>.json (the coordinates parallel_state assigned); rank 0 writes DIR/hf.safetensors (gather_to_hf).
`--mode logp`: vocab_parallel_logp and vocab_parallel_entropy over the world as one TP group; writes
DIR/rank<R>.json with their deviations from the full-vocab token_logp / token_entropy (values and gradients).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import torch

from tests.ranks import join_cpu_group, leave_cpu_group

VOCAB, PADDED, TEMPERATURE = 300, 384, 0.7


def random_canonical(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights at a scale that keeps a forward finite: norms near 1, matrices ~ N(0, 0.05)."""
    g = torch.Generator().manual_seed(seed)
    return {n: 1 + 0.1 * torch.randn(shape, generator=g) if len(shape) == 1 else 0.05 * torch.randn(shape, generator=g)
            for n, shape in spec.canonical().items()}


def tokens(spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, next-token targets) [2, 12] every rank and the reference agree on."""
    ids = torch.randint(0, spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def hf_reference_logp(model_name: str, canonical: dict[str, torch.Tensor]) -> torch.Tensor:
    """token_logp of the transformers model holding `canonical` (Qwen3-MoE routing renormalised, top-2)."""
    import transformers

    from services.trainer.algorithms import token_logp
    from services.trainer.megatron.convert import to_hf_module
    from services.weight_exchange.client.layouts.model import BUILTIN, model_spec

    fields = dict(BUILTIN[model_name])
    extra = dict(num_experts_per_tok=2, norm_topk_prob=True) if fields["model_type"] == "qwen3_moe" else {}
    config = transformers.CONFIG_MAPPING[fields.pop("model_type")](**fields, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    result = model.load_state_dict(to_hf_module(canonical, model.state_dict()), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result  # tied alias
    ids, targets = tokens(model_spec(model_name))
    with torch.no_grad():
        return token_logp(model(ids).logits, targets)


def cpu_forward() -> None:
    """megatron-core's forward asks CUDA for the rotary table's device and forks a CUDA RNG around attention
    dropout; on a CPU-only torch both would raise, so point them at the CPU (dropout is off)."""
    import contextlib

    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def convert(a, out: pathlib.Path) -> None:
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from services.trainer.megatron.convert import gather_to_hf, hf_to_megatron, rank_parallel
    from services.trainer.megatron.model import build_gpt_model, current_parallel
    from services.weight_exchange.client.layouts.model import model_spec
    from services.weight_exchange.client.layouts.topology import parse_side

    side = parse_side(a.side)
    ps.initialize_model_parallel(tensor_model_parallel_size=side.get("tp"),
                                 pipeline_model_parallel_size=side.get("pp"),
                                 expert_model_parallel_size=side.get("ep"),
                                 expert_tensor_parallel_size=side.sizes.get("etp", side.get("tp")))
    spec = model_spec(a.model)
    live = current_parallel()
    model = build_gpt_model(spec, live, max_sequence_length=64)
    expected = rank_parallel(spec, side, a.rank)
    state = hf_to_megatron(random_canonical(spec), spec, expected)
    model.load_state_dict(state, strict=True)
    back = {n: t.detach().clone().contiguous() for n, t in model.state_dict().items() if torch.is_tensor(t)}
    save_file(back, str(out / f"rank{a.rank}.safetensors"))
    exported = gather_to_hf(model.state_dict(), spec, side)
    if exported is not None:
        save_file(exported, str(out / "hf.safetensors"))
    coords = dataclasses.asdict(live)
    logp = None
    if side.get("pp") == 1:   # a pipeline needs a schedule, not one call
        from services.trainer.megatron.loss import vocab_parallel_logp

        cpu_forward()
        ids, targets = tokens(spec)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[None, None]
        model.eval()
        with torch.no_grad():
            logits = model(ids, positions, mask)
        logp = vocab_parallel_logp(logits, targets, ps.get_tensor_model_parallel_group(), 1.0, spec.vocab_size)
    (out / f"rank{a.rank}.json").write_text(json.dumps({
        "logp": None if logp is None else logp.tolist(),
        "live": {k: coords[k] for k in ("tp_rank", "pp_rank", "ep_rank", "etp_rank", "dp_rank")},
        "expected": {k: dataclasses.asdict(expected)[k] for k in ("tp_rank", "pp_rank", "ep_rank", "etp_rank",
                                                                   "dp_rank")},
        "params": sorted(n for n, _ in model.named_parameters())}))


def logp(a, out: pathlib.Path) -> None:
    from services.trainer.algorithms import token_entropy, token_logp
    from services.trainer.megatron.loss import vocab_parallel_entropy, vocab_parallel_logp

    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, PADDED, generator=g, dtype=torch.float64).float() * 4
    targets = torch.randint(0, VOCAB, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g)
    width = PADDED // a.world
    cols = slice(a.rank * width, (a.rank + 1) * width)

    def errors(parallel, reference) -> dict[str, float]:
        """max |value - ref| and max |grad - ref grad| on this rank's columns of sum(weights * f)."""
        shard = full[..., cols].clone().requires_grad_(True)
        got = parallel(shard)
        (got * weights).sum().backward()
        ref_logits = full[..., :VOCAB].clone().requires_grad_(True)
        want = reference(ref_logits)
        (want * weights).sum().backward()
        ref_grad = torch.nn.functional.pad(ref_logits.grad, (0, PADDED - VOCAB))[..., cols]
        return {"value": (got - want).abs().max().item(), "scale": want.abs().max().item(), "grad": (shard.grad - ref_grad).abs().max().item(),
                "grad_norm": ref_grad.norm().item()}

    (out / f"rank{a.rank}.json").write_text(json.dumps({
        "logp": errors(lambda x: vocab_parallel_logp(x, targets, None, TEMPERATURE, vocab_size=VOCAB),
                       lambda x: token_logp(x, targets, TEMPERATURE)),
        "entropy": errors(lambda x: vocab_parallel_entropy(x, None, TEMPERATURE, vocab_size=VOCAB),
                          lambda x: token_entropy(x, TEMPERATURE))}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("convert", "logp"), required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True, help="a file every rank names: the rendezvous")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--side", default="megatron")
    a = ap.parse_args()
    join_cpu_group(a.rank, a.world, a.store)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        (convert if a.mode == "convert" else logp)(a, out)
    except BaseException:
        torch.distributed.destroy_process_group()
        raise
    leave_cpu_group()


if __name__ == "__main__":
    main()
