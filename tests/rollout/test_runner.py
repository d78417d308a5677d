"""The model runner's KV bookkeeping: rows admitted into a running batch (prefilled alone, merged into the
left-padded cache) and rows dropped from it get exactly the log-probs a fresh forward over each context gives."""

from __future__ import annotations

import torch

from services.rollout.engines.runner import ModelRunner
from services.rollout.engines.scheduler import Scheduler
from services.rollout.engines.sequence import Sampling, Sequence
from tests.rollout.test_engine import EOS, full_forward_logprobs, tiny_model


def run_to_end(scheduler: Scheduler, runner: ModelRunner, arrivals: dict[int, list[Sequence]]) -> list:
    steps, t = [], 0
    while scheduler.has_work() or any(k >= t for k in arrivals):
        for seq in arrivals.get(t, []):
            scheduler.add(seq)
        if scheduler.has_work():
            step = scheduler.schedule()
            tokens, logprobs = runner.run(step)
            scheduler.postprocess(step.rows, tokens, logprobs, version=0)
            steps.append(step)
        t += 1
    return steps


def test_admitted_and_compacted_rows_match_a_fresh_forward():
    model = tiny_model(3)
    scheduler = Scheduler(max_batch=3, eos_token_id=EOS, max_context=256, refill_fraction=0.5)
    runner = ModelRunner(model, pad_token_id=0, seed=0)

    def seq(prompt: list[int], n: int, *, priority: bool = False) -> Sequence:
        sampling = Sampling(temperature=1.0, max_new_tokens=n, stop_token_ids=())
        return Sequence(prompt_ids=prompt, sampling=sampling, priority=priority)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (5, 11, 2, 7, 3)]
    a, b = seq(prompts[0], 6), seq(prompts[1], 9, priority=True)
    c, d, e = seq(prompts[2], 4), seq(prompts[3], 8, priority=True), seq(prompts[4], 5, priority=True)
    steps = run_to_end(scheduler, runner, {0: [a], 3: [b], 4: [c], 5: [d, e]})

    for s in (a, b, c, d, e):
        assert s.finish_reason in ("length", "stop"), s.finish_reason
        expected = full_forward_logprobs(model, s.prompt_ids, s.output_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=1e-4)
    assert [st.prefill for st in steps].count(True) == 1, "only the first batch is a full prefill"
    assert any(st.new and st.keep for st in steps), "sequences joined a running batch"
    assert any(st.keep != tuple(range(len(st.keep))) for st in steps if not st.prefill), "finished rows were dropped"
    assert runner.prefilled_rows == 5, "each context went through the model once: nothing was re-prefilled"


async def test_a_model_step_that_fails_for_the_batch_but_not_for_its_rows_ends_nothing():
    """A step that fails once (say, out of memory) is retried row by row: every row that runs alone goes on with the
    token its own run sampled, and the next batch is rebuilt from scratch. Only rows that fail alone end ("error")."""
    from services.rollout.engines.torch_engine import EmbeddedEngine

    model = tiny_model(4)
    engine = EmbeddedEngine(model, eos_token_id=EOS, pad_token_id=0, max_batch=4, max_context=256, seed=0)
    real_run, calls = engine.runner.run, []

    def flaky_run(step):
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("simulated out-of-memory")
        return real_run(step)

    engine.runner.run = flaky_run
    engine.start()
    try:
        first = await engine.generate([5, 6, 7], Sampling(temperature=1.0, max_new_tokens=6), n=1)
        assert first[0].finish_reason in ("length", "stop") and first[0].output_ids, "the row survived the failed step"
        assert calls[2].prefill and calls[2].rows == [first[0]], "the failed step's row was run alone"
        assert engine.stats.steps_failed == 1 and engine.stats.sequences_failed == 0
        second = await engine.generate([5, 6, 7], Sampling(temperature=1.0, max_new_tokens=6), n=1)
        assert second[0].finish_reason in ("length", "stop") and second[0].output_ids, "the engine still generates"
    finally:
        engine.stop()
