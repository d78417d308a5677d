"""Sequence packing: first-fit-decreasing bins, and packed forwards (prompts shared within a group or not) that give
what the padded ones give (log-probs, logits, entropies, gradients, a whole train_step) on tiny Qwen3 and Llama."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from services.common.contracts import data_pb2
from services.trainer.algorithms import AlgorithmConfig, token_entropy, token_logp
from services.trainer.batching import PackedBatch, pack
from services.trainer.forward import TeacherTopK, logp_and_entropy, policy_logp, sequence_logits, token_terms
from services.trainer.models import TinyQwen3Config
from services.trainer.packing import PackingConfig, first_fit_decreasing, pack_rows, packed_forwards
from services.trainer.step import OptimConfig, train_step

VOCAB = 320
PACKED = PackingConfig(enabled=True, max_tokens=24)
LAYOUTS = {"shared": PACKED, "unshared": PackingConfig(enabled=True, max_tokens=24, share_prompts=False),
           "tight": PackingConfig(enabled=True, max_tokens=8)}  # groups split over bins, long rows alone


def qwen3(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyQwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, intermediate_size=64).build(VOCAB)
    model.config._attn_implementation = attn
    return model


def llama() -> torch.nn.Module:  # SmolLM2's architecture
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, pad_token_id=2, bos_token_id=1, eos_token_id=2))


MODELS = {"qwen3-sdpa": lambda: qwen3("sdpa"), "qwen3-eager": lambda: qwen3("eager"), "llama-sdpa": llama}


def batch(rows: int = 9, seed: int = 0) -> PackedBatch:
    """Groups of three rows with a common prompt, of different prompt and completion lengths; one completion
    with an untrained (tool) token."""
    rng = random.Random(seed)
    trajs = []
    for i in range(rows):
        if i % 3 == 0:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        n = rng.randint(1, 8)
        mask = [1] * n
        if i == 0 and n > 2:
            mask[1] = 0
        trajs.append(data_pb2.Trajectory(
            trajectory_id=f"t{i}", group_id=f"g{i // 3}", prompt_ids=prompt,
            completion_ids=[rng.randrange(VOCAB) for _ in range(n)], behavior_logprobs=[-1.0] * n,
            versions=[0] * n, loss_mask=mask, reward=float(i % 2), finish_reason="stop"))
    return pack(trajs, 0)


@pytest.mark.parametrize("seed", range(20))
def test_first_fit_decreasing_places_every_row_once_within_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 60))]
    budget = rng.randint(1, 80)
    bins = first_fit_decreasing(lengths, budget)
    assert sorted(row for b in bins for row in b) == list(range(len(lengths)))
    assert all(sum(lengths[r] for r in b) <= max(budget, max(lengths)) for b in bins)
    assert all(len(b) == 1 for b in bins if sum(lengths[r] for r in b) > budget)  # only a lone long row overflows


def test_first_fit_decreasing_fills_bins_and_rejects_bad_settings():
    assert first_fit_decreasing([3, 5, 2, 4, 1], 5) == [[1], [3, 4], [0, 2]]
    with pytest.raises(ValueError, match="budget"):
        first_fit_decreasing([1], 0)
    with pytest.raises(ValueError, match="max_tokens"):
        PackingConfig(enabled=True, max_tokens=0)
    model = qwen3("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with packed_forwards(PACKED), pytest.raises(ValueError, match="attention implementation"):
        policy_logp(model, batch(), 1.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_rows_puts_each_row_back_where_it_came_from_and_sees_only_its_own_tokens(layout):
    b, config = batch(rows=12), LAYOUTS[layout]
    packing = pack_rows(b.input_ids, b.attention_mask, b.lengths, config)
    assert packing.real_tokens() == int(b.attention_mask.sum())
    shared = sum(int(b.attention_mask[i].sum() - b.lengths[i]) for i in range(b.size) if i % 3)  # prompts 2 and 3
    if config.share_prompts:  # a group too long for one bin is split, each part with its prompt
        assert packing.real_tokens() - shared <= packing.forward_tokens <= packing.real_tokens()
        roomy = pack_rows(b.input_ids, b.attention_mask, b.lengths, PackingConfig(enabled=True, max_tokens=1000))
        assert roomy.forward_tokens == packing.real_tokens() - shared
    else:
        assert packing.forward_tokens == packing.real_tokens()
    for i in range(b.size):
        n = int(b.attention_mask[i].sum())
        cols = torch.arange(n)
        bins, where = packing.locate(torch.full((n,), i), cols)
        assert torch.equal(packing.input_ids[bins, where], b.input_ids[i, :n])
        assert torch.equal(packing.position_ids[bins, where], cols)
        seen = packing.attention[bins[-1], 0, where[-1]]  # what the row's last token attends to: the row, no more
        assert int(seen.sum()) == n and bool(seen[where].all())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_packed_log_probs_logits_and_entropies_equal_the_padded_ones(name, layout):
    model, b = MODELS[name]().eval(), batch()
    trained, real = b.loss_mask.bool(), b.attention_mask[:, 1:].bool()
    with torch.no_grad():
        logits = sequence_logits(model, b)
        with packed_forwards(LAYOUTS[layout]):
            packed_logp = policy_logp(model, b, 0.7)
            packed_logits = sequence_logits(model, b)
            logp, entropy = logp_and_entropy(model, b, 0.7, entropy_grad=False)
            top, ids = torch.log_softmax(logits.flip(-1), -1).topk(4, dim=-1)   # another model's 4 likeliest
            teacher = TeacherTopK(ids, top)
            *_, packed_kl = token_terms(model, b, 0.7, entropy_grad=False, teacher=teacher)
        *_, padded_kl = token_terms(model, b, 0.7, entropy_grad=False, teacher=teacher)
    padded_logp = token_logp(logits, b.input_ids[:, 1:], 0.7)
    torch.testing.assert_close(packed_kl[trained], padded_kl[trained], atol=1e-5, rtol=1e-5)
    assert torch.all(packed_kl[~trained] == 0) and float(padded_kl[trained].min()) > 0
    torch.testing.assert_close(packed_logp[trained], padded_logp[trained], atol=1e-5, rtol=1e-5)
    assert torch.all(packed_logp[~trained] == 0)
    torch.testing.assert_close(packed_logits[real], logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logp, packed_logp)
    torch.testing.assert_close(entropy[trained], token_entropy(logits, 0.7)[trained], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_packed_gradients_equal_the_padded_ones(name, layout):
    b = batch(seed=1)

    def grads(packing: PackingConfig) -> list[torch.Tensor]:
        model = MODELS[name]()
        with packed_forwards(packing):
            logp, entropy = logp_and_entropy(model, b, 1.0, entropy_grad=True)
        ((logp - 0.1 * entropy) * b.loss_mask).sum().backward()
        return [p.grad for p in model.parameters()]

    for padded, packed in zip(grads(PackingConfig()), grads(LAYOUTS[layout]), strict=True):
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-4)


def test_a_packed_train_step_matches_a_padded_one():
    b = batch(rows=12, seed=2)

    def step(packing: PackingConfig):
        model = qwen3("sdpa")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        algo = AlgorithmConfig.from_preset("grpo", entropy_coef=0.01).build()
        with packed_forwards(packing):
            metrics = train_step(model, optimizer, algo, b, version=0, optim=OptimConfig(lr=1e-2, minibatches=2),
                                 temperature=1.0, generator=torch.Generator().manual_seed(0))
        return model, metrics

    (padded, m0), (packed, m1) = step(PackingConfig()), step(PACKED)
    assert m0.keys() == m1.keys()
    for key in m0:
        assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-5), key
    # Adam divides by the gradient's own scale, so float-rounding noise in a near-zero gradient moves its parameter
    # by up to ~lr-sized fractions: 1e-4 is still 100x below one lr step (1e-2)
    for a, c in zip(padded.parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(c, a, atol=1e-4, rtol=1e-3)


def test_packed_log_probs_through_lora_adapters_equal_the_padded_ones():
    from services.trainer.lora import LoraConfig

    model, b = LoraConfig(enabled=True, r=4).build(qwen3("sdpa")), batch()
    for name, param in model.named_parameters():
        if "lora_B" in name:  # zero at init: make the adapters count
            torch.nn.init.normal_(param, std=0.1)
    trained = b.loss_mask.bool()
    with torch.no_grad():
        padded = policy_logp(model, b, 1.0)
        with packed_forwards(PACKED):
            packed = policy_logp(model, b, 1.0)
    torch.testing.assert_close(packed[trained], padded[trained], atol=1e-5, rtol=1e-5)


def _computed_tokens(b: PackedBatch) -> int:
    """Tokens a packed forward of `b` computes: each distinct shared prompt once, every completion."""
    packing = pack_rows(b.input_ids, b.attention_mask, b.lengths, PackingConfig(enabled=True))
    prompts = {(int(bin_), int(start)): int(n) for bin_, start, n in
               zip(packing.bin_of, packing.prompt_start, packing.prompt_length, strict=True)}
    return sum(prompts.values()) + int(b.lengths.sum())


def test_minibatches_of_whole_groups_keep_each_groups_prompt_shared():
    from services.trainer.step import minibatches

    b = batch(rows=24)  # 8 groups of 3
    by_group, by_row = OptimConfig(minibatches=4, epochs=2, split="groups"), OptimConfig(minibatches=4, epochs=2)
    parts = list(minibatches(b.size, by_group, torch.Generator().manual_seed(0), b.group_ids))
    assert len(parts) == 8
    for epoch in (parts[:4], parts[4:]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(24))  # every row once an epoch
        for part in epoch:  # whole groups: each group in the part with all three of its rows
            assert torch.bincount(b.group_ids[part]).tolist().count(3) == len(set(b.group_ids[part].tolist()))
    rows = list(minibatches(b.size, by_row, torch.Generator().manual_seed(0), b.group_ids))
    assert sorted(torch.cat(rows[:4]).tolist()) == list(range(24))
    grouped = sum(_computed_tokens(b.rows(p)) for p in parts[:4])
    scattered = sum(_computed_tokens(b.rows(p)) for p in rows[:4])
    assert grouped == _computed_tokens(b) < scattered  # the split costs nothing; rows alone recompute prompts
    # fewer groups than minibatches: one minibatch per group
    assert len(list(minibatches(6, by_group, torch.Generator(), torch.tensor([5, 5, 5, 9, 9, 9])))) == 4
    with pytest.raises(ValueError, match="optim.split"):
        OptimConfig(split="tokens")
