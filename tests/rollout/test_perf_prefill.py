"""Shared-prompt prefill: the samples of one prompt run their common context through the model once, and each
still gets exactly the log-probs a fresh forward over its own context gives."""

from __future__ import annotations

import torch

from services.rollout.engines.runner import ModelRunner
from services.rollout.engines.scheduler import Scheduler
from services.rollout.engines.sequence import Sampling, Sequence
from tests.rollout.test_engine import EOS, full_forward_logprobs, tiny_model
from tests.rollout.test_runner import run_to_end


def test_samples_of_one_prompt_prefill_once_and_match_a_fresh_forward():
    model = tiny_model(5)
    scheduler = Scheduler(max_batch=16, eos_token_id=EOS, max_context=256)
    runner = ModelRunner(model, pad_token_id=0, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (7, 3, 12)]
    seqs = [Sequence(prompt_ids=list(p), sampling=Sampling(temperature=1.0, max_new_tokens=6))
            for p in prompts for _ in range(4)]
    run_to_end(scheduler, runner, {0: seqs})
    assert runner.prefilled_rows == 12 and runner.prefilled_contexts == 3, "one forward per distinct prompt"
    assert len({tuple(s.output_ids) for s in seqs}) > 3, "the samples of a prompt are still sampled apart"
    for s in seqs:
        expected = full_forward_logprobs(model, s.prompt_ids, s.output_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_inverse_cdf_sampling_keeps_the_distribution_and_never_draws_a_truncated_token():
    from services.rollout.engines.sampler import sample

    g = torch.Generator().manual_seed(0)
    rows = 20000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(rows, 1)
    ones, no_k = torch.ones(rows), torch.zeros(rows, dtype=torch.long)
    tokens, logprobs = sample(logits, ones, ones, no_k, g)
    torch.testing.assert_close(torch.bincount(tokens, minlength=4) / rows, torch.softmax(logits[0], -1), atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))
    top2, _ = sample(logits, ones, ones, torch.full((rows,), 2, dtype=torch.long), g)
    assert set(top2.tolist()) == {1, 2}, "top-k: only the two likeliest tokens"
    nucleus, _ = sample(logits, ones, torch.full((rows,), 0.5), no_k, g)
    assert set(nucleus.tolist()) == {2}, "top-p 0.5: the likeliest token alone holds that mass"
