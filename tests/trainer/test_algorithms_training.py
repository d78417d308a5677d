"""A tiny random Qwen3 trained a few steps with each preset, asynchronously (stale rollouts)."""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.trainer.algorithms import ONLINE_PRESETS, AlgorithmConfig, sequence_logp, token_entropy, token_logp

PROMPTS, GROUP, PROMPT_LEN, NEW = 4, 4, 3, 5
STEPS = 3


@pytest.fixture(scope="module")
def base_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return Qwen3ForCausalLM(config).eval()


def forward(model, ids: torch.Tensor, hidden: bool = False):
    """Per-position log-prob of the next token and entropy, float[B, L-1] (plus last hidden states)."""
    out = model(input_ids=ids, output_hidden_states=hidden)
    logits = out.logits[:, :-1]
    logp, entropy = token_logp(logits, ids[:, 1:]), token_entropy(logits)
    return (logp, entropy, out.hidden_states[-1][:, :-1]) if hidden else (logp, entropy)


@pytest.fixture(scope="module")
def rollout(base_model):
    """Sampled by policy version 0: ids, loss mask over completion tokens, behaviour log-probs, rewards."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 64, (PROMPTS, PROMPT_LEN), generator=g).repeat_interleave(GROUP, 0)
    ids = prompts
    with torch.no_grad():
        for _ in range(NEW):
            probs = torch.softmax(base_model(input_ids=ids).logits[:, -1].float(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], 1)
        behav, _ = forward(base_model, ids)
    mask = torch.zeros_like(behav)
    mask[:, PROMPT_LEN - 1 :] = 1  # positions predicting the completion tokens
    rewards = (ids[:, PROMPT_LEN:] < 32).float().mean(-1) + ids[:, PROMPT_LEN:].float().mean(-1) / 640
    group_ids = torch.arange(PROMPTS).repeat_interleave(GROUP)
    rewards[group_ids == 0] = 1.0  # one group with no signal, for dynamic sampling
    versions = torch.where(mask.bool(), 0, -1)
    return dict(ids=ids, mask=mask, behav=behav, rewards=rewards, group_ids=group_ids, versions=versions)


# gkd's loss is the teacher's top-k KL, with no advantage: tests/trainer/test_distill.py trains it
@pytest.mark.parametrize("name", [*(p for p in ONLINE_PRESETS if p != "gkd"), "sft"])
def test_preset_trains_tiny_model(name, base_model, rollout):
    algo = AlgorithmConfig.from_preset(name, max_new_tokens=NEW, overlong_tokens=2).build()
    model = copy.deepcopy(base_model).train()
    value_head = torch.nn.Linear(32, 1)
    params = [*model.parameters(), *value_head.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    keep = algo.filter_groups(rollout["rewards"], rollout["group_ids"])
    if name == "dapo":
        assert keep.tolist() == [False] * GROUP + [True] * (PROMPTS - 1) * GROUP
    else:
        assert keep.all()
    ids, mask, behav, versions = (rollout[k][keep] for k in ("ids", "mask", "behav", "versions"))
    ref = behav  # the reference model is the initial policy
    with torch.no_grad():
        if algo.config.distill_coef > 0:   # distillation's reference is a teacher: another model
            teacher = copy.deepcopy(base_model)
            g = torch.Generator().manual_seed(7)
            for p in teacher.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=0.02))
            ref = forward(teacher, ids)[0]
        old_values = value_head(forward(model, ids, hidden=True)[2]).squeeze(-1)
    result = algo.compute_advantages(
        rollout["rewards"][keep], rollout["group_ids"][keep], mask, values=old_values, old_logp=behav, ref_logp=ref
    )
    adv = result.advantages
    assert adv.abs().sum() > 0 and adv[~mask.bool()].eq(0).all()

    def loss_at(version: int, prox):
        logp, entropy, hidden = forward(model, ids, hidden=True)
        loss, stats = algo.policy_loss(
            logp=logp,
            prox_logp=prox,
            behav_logp=behav,
            advantages=adv,
            loss_mask=mask,
            versions=versions,
            current_version=version,
            entropy=entropy,
            ref_logp=ref,
        )
        if algo.needs_critic:
            v_loss, _ = algo.value_loss(value_head(hidden).squeeze(-1), old_values, result.returns, mask)
            loss = loss + 0.5 * v_loss
        return loss, stats

    for version in range(STEPS):  # the rollout grows one version staler every step
        with torch.no_grad():
            prox = forward(model, ids)[0] if algo.needs_prox_logp else None
        loss, stats = loss_at(version, prox)
        assert torch.isfinite(loss), (name, version, stats)
        assert all(v == v for v in stats.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        new_logp, _ = forward(model, ids)
    trained = mask.bool()
    assert (new_logp - behav)[trained].abs().max() > 1e-3, name  # the policy moved
    if name == "sft":
        assert -new_logp[trained].mean() < -behav[trained].mean()
    else:
        # ... in the direction of the advantages: E_behav[A * (pi_new / pi_behav - 1)] > 0
        # (the objectives' values are not comparable across presets; CISPO's is not even a surrogate)
        assert (adv * torch.expm1(new_logp - behav))[trained].mean() > 0, name
    if name == "m2po":
        assert "m2po_masked_fraction" in stats


def test_dpo_raises_chosen_over_rejected_margin(base_model):
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(0, 64, (6, PROMPT_LEN), generator=g)
    chosen = torch.cat([prompts, torch.randint(0, 32, (6, NEW), generator=g)], 1)
    rejected = torch.cat([prompts, torch.randint(32, 64, (6, NEW), generator=g)], 1)
    mask = torch.zeros(6, PROMPT_LEN + NEW - 1)
    mask[:, PROMPT_LEN - 1 :] = 1
    algo = AlgorithmConfig.from_preset("dpo").build()
    model = copy.deepcopy(base_model).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def seq_logps(m):
        return sequence_logp(forward(m, chosen)[0], mask), sequence_logp(forward(m, rejected)[0], mask)

    with torch.no_grad():
        ref_c, ref_r = seq_logps(base_model)
    margins = []
    for _ in range(8):
        loss, stats = algo.preference_loss(*seq_logps(model), ref_c, ref_r)
        margins.append(stats["dpo_margin"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert margins[0] == pytest.approx(0.0, abs=1e-5)  # policy == reference at the start
    assert margins[-1] > margins[0] + 0.05 and stats["dpo_accuracy"] == 1.0
