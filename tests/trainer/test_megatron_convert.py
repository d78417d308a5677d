"""HF <-> megatron-core conversion (services.trainer.megatron) and vocab-parallel log-probs, on CPU.

Pure round trips HF -> every rank's Megatron state -> HF are bit-exact. Real ranks (gloo, file:// rendezvous,
one process each) build megatron-core GPTModels, load their converted state with strict=True, and the live
parameters they read back convert to the same HF tensors; without a pipeline they also run a forward whose
vocab-parallel log-probs match the transformers model's.
"""

from __future__ import annotations

import json

import pytest
import torch

from services.trainer.megatron.convert import hf_to_megatron, megatron_to_hf, padded_vocab, rank_parallel
from services.weight_exchange.client.layouts.model import model_spec
from services.weight_exchange.client.layouts.topology import parse_side
from tests.ranks import run_module_ranks
from tests.trainer.megatron_rank import random_canonical

SIDES = ["megatron:tp=2", "megatron:pp=2", "megatron:dp=2,ep=2", "megatron:tp=2,pp=2,dp=2,ep=2,etp=1",
         "megatron:tp=4"]


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    unequal = [n for n in want if not torch.equal(got[n], want[n])]
    assert not unequal, unequal[:5]


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2"])
@pytest.mark.parametrize("side_text", SIDES)
def test_round_trip_is_bit_exact(model, side_text):
    spec, side = model_spec(model), parse_side(side_text)
    hf = random_canonical(spec)
    states = [hf_to_megatron(hf, spec, rank_parallel(spec, side, r)) for r in range(side.world)]
    assert_same(megatron_to_hf(states, spec, side), hf)


def test_vocab_padding_rows_are_zero_and_dropped():
    spec, side = model_spec("tiny-qwen3-moe"), parse_side("megatron:tp=2")   # vocab 300 -> 512
    hf = random_canonical(spec)
    states = [hf_to_megatron(hf, spec, rank_parallel(spec, side, r)) for r in range(2)]
    par = rank_parallel(spec, side, 1)
    assert padded_vocab(spec, par) == 512
    emb = states[1]["embedding.word_embeddings.weight"]
    assert emb.shape == (256, spec.hidden_size)
    assert torch.equal(emb[:300 - 256], hf["model.embed_tokens.weight"][256:]) and not emb[300 - 256:].any()
    assert megatron_to_hf(states, spec, side)["lm_head.weight"].shape == (300, spec.hidden_size)


def test_rank_holding_only_padding_gets_a_zero_vocab_shard():
    spec, side = model_spec("tiny-qwen2"), parse_side("megatron:tp=4")   # vocab 256 -> 512: ranks 2, 3 pad
    state = hf_to_megatron(random_canonical(spec), spec, rank_parallel(spec, side, 3))
    assert state["output_layer.weight"].shape == (128, spec.hidden_size) and not state["output_layer.weight"].any()


def test_missing_ranks_and_tensors_are_user_errors():
    spec, side = model_spec("tiny-qwen3"), parse_side("megatron:tp=2")
    hf = random_canonical(spec)
    states = {0: hf_to_megatron(hf, spec, rank_parallel(spec, side, 0))}
    with pytest.raises(ValueError, match="partly held"):
        megatron_to_hf(states, spec, side)
    del hf["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        hf_to_megatron(hf, spec, rank_parallel(spec, side, 0))


# real megatron-core ranks -------------------------------------------------------------------------------------
def launch(tmp_path, mode: str, world: int, args: list[str], deadline_s: float = 240) -> list[str]:
    """Every rank of tests.trainer.megatron_rank in `mode`; the failed ranks' stderr tails."""
    return run_module_ranks("tests.trainer.megatron_rank", world, tmp_path, [f"--mode={mode}", f"--out={tmp_path}",
                                                                              *args], deadline_s=deadline_s)


def run_ranks(tmp_path, model: str, side_text: str) -> None:
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from tests.trainer.megatron_rank import hf_reference_logp

    spec, side = model_spec(model), parse_side(side_text)
    failures = launch(tmp_path, "convert", side.world, [f"--model={model}", f"--side={side_text}"])
    assert not failures, failures[0]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(side.world)]
    for r, report in enumerate(reports):
        assert report["live"] == report["expected"], (r, report)
    states = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(side.world)]
    hf = random_canonical(spec)
    assert_same(megatron_to_hf(states, spec, side), hf)
    assert_same(load_file(str(tmp_path / "hf.safetensors")), hf)
    if side.get("pp") == 1:
        want = hf_reference_logp(model, hf)
        for r, report in enumerate(reports):
            err = (torch.tensor(report["logp"]) - want).abs().max().item()
            assert err < 1e-4, (r, err)


@pytest.mark.parametrize("model,side", [("tiny-qwen3", "megatron:tp=2"), ("tiny-qwen3-moe", "megatron:dp=2,ep=2")])
def test_live_megatron_ranks(tmp_path, model, side):
    run_ranks(tmp_path, model, side)


@pytest.mark.full
@pytest.mark.parametrize("model,side", [
    ("tiny-qwen3", "megatron:pp=2"),                          # tied embeddings across stages
    ("tiny-qwen2", "megatron:tp=2"),                          # qkv bias, untied
    ("tiny-qwen3-moe", "megatron:tp=2,ep=2,etp=1,dp=2"),
    ("tiny-qwen3-moe", "megatron:tp=2,pp=2,ep=2,etp=1,dp=2"),
])
def test_live_megatron_ranks_more(tmp_path, model, side):
    run_ranks(tmp_path, model, side)


def test_vocab_parallel_logp_and_entropy_match_full_vocab(tmp_path):
    failures = launch(tmp_path, "logp", 2, [], deadline_s=120)
    assert not failures, failures[0]
    for r in range(2):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        for what in ("logp", "entropy"):
            err = report[what]   # float32 values near 10 differ by an ulp (~1e-6) between reduction orders
            assert err["value"] <= 1e-6 * max(1.0, err["scale"]) and err["grad"] < 1e-6 and err["grad_norm"] > 0, (r, what, err)
