"""Megatron layouts against a real megatron-core GPTModel built on CPU (gloo, use_cpu_initialization).

Every parameter name and shape of every rank must be what `megatron_shards` declares, and the rank
coordinates (tp, pp, ep, etp, dp) must be what the topology assigns to that global rank.
"""

from __future__ import annotations

import json

import pytest

from services.weight_exchange.client.layouts.megatron import stage_layers
from services.weight_exchange.client.layouts.model import model_spec
from services.weight_exchange.client.layouts.topology import megatron_parallel, parse_side, rank_shards
from tests.ranks import run_module_ranks

pytest.importorskip("megatron.core")

PADDING_ONLY = ("embedding.word_embeddings.weight", "output_layer.weight")


def launch(tmp_path, model: str, side, args: list[str]) -> list[str]:
    """Every rank of tests.weight_exchange.megatron_proc; the failed ranks' stderr tails."""
    return run_module_ranks("tests.weight_exchange.megatron_proc", side.world, tmp_path,
                            [f"--model={model}", f"--out={tmp_path}", *args], deadline_s=300)


def build(tmp_path, model: str, side_text: str) -> None:
    side = parse_side(side_text)
    args = [f"--{k}={side.get(k)}" for k in ("tp", "pp", "ep")]
    args.append(f"--etp={side.sizes.get('etp', side.get('tp'))}")
    args += [f"--{k}={side.sizes[k]}" for k in ("first", "last") if k in side.sizes]
    args += ["--unpadded"] if "unpadded" in side.sizes else []
    args += [f"--vocab-div={side.sizes['vocab_div']}"] if "vocab_div" in side.sizes else []
    failures = launch(tmp_path, model, side, args)
    assert not failures, failures[0]
    spec = model_spec(model)
    for r in range(side.world):
        real = json.loads((tmp_path / f"rank{r}.json").read_text())
        par = megatron_parallel(side, r, spec.num_layers)
        assert real["layers"] == list(stage_layers(spec, par)), (r, real["layers"])
        coords = {"tp_rank": par.tp_rank, "pp_rank": par.pp_rank, "ep_rank": par.ep_rank,
                  "etp_rank": par.etp_rank, "dp_rank": par.dp_rank}
        assert {k: real["parallel"][k] for k in coords} == coords, (r, real["parallel"])
        shards, _ = rank_shards(spec, side, r)
        declared = {s.local_name: list(s.local_shape) for s in shards}
        actual = real["params"]
        assert {k: actual.get(k) for k in declared} == declared, r
        assert [k for k in actual if k not in declared and k not in PADDING_ONLY] == [], r


@pytest.mark.parametrize("model,side", [("tiny-qwen3", "megatron:tp=2"), ("tiny-qwen3-moe", "megatron:dp=2,ep=2"),
                                        ("tiny-qwen3", "megatron:pp=2,first=1"),     # Megatron's rule: (1, 3)
                                        ("tiny-qwen3", "megatron:tp=2,unpadded=1")])  # vocab 264 -> 132 per rank
def test_megatron_names_and_shapes(tmp_path, model, side):
    build(tmp_path, model, side)


@pytest.mark.full
@pytest.mark.parametrize("model,side", [
    ("tiny-qwen3", "megatron:pp=2"),
    ("tiny-qwen3", "megatron:tp=4"),                         # TP 4 > 2 query groups
    ("tiny-qwen2", "megatron:tp=2"),                         # qkv bias
    ("tiny-qwen3-moe", "megatron:tp=2,pp=2,ep=2,etp=1"),
    ("tiny-qwen3", "megatron:pp=2,last=1"),
    ("tiny-qwen3", "megatron:tp=2,vocab_div=64"),
])
def test_megatron_names_and_shapes_more(tmp_path, model, side):
    build(tmp_path, model, side)
