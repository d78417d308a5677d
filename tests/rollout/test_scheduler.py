"""The pure scheduler: batch formation, refills, finishing, priority requests, aborts."""

from __future__ import annotations

import pytest

from services.rollout.engines.scheduler import Scheduler, Step
from services.rollout.engines.sequence import Sampling, Sequence, Status

EOS = 1


def seq(prompt=(5, 6), *, priority=False, max_new_tokens=4) -> Sequence:
    return Sequence(prompt_ids=list(prompt), sampling=Sampling(max_new_tokens=max_new_tokens), priority=priority)


def test_first_schedule_prefills_then_decodes():
    s = Scheduler(max_batch=4, eos_token_id=EOS, max_context=64)
    a, b = seq(), seq()
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert step == Step([a, b], prefill=True) and a.status is Status.RUNNING
    s.postprocess(step.rows, [7, 8], [-0.1, -0.2], version=0)
    assert s.schedule() == Step([a, b], prefill=False, keep=(0, 1), new=0)


def test_tokens_finish_on_eos_stop_ids_and_length():
    s = Scheduler(max_batch=4, eos_token_id=EOS, max_context=64)
    a, b = seq(max_new_tokens=2), seq()
    c = Sequence(prompt_ids=[5], sampling=Sampling(max_new_tokens=5, stop_token_ids=(9,)))
    for x in (a, b, c):
        s.add(x)
    rows = s.schedule().rows
    assert s.postprocess(rows, [7, EOS, 9], [0.0] * 3, version=3) == [b, c]
    assert (b.finish_reason, c.finish_reason) == ("stop", "stop")
    assert s.postprocess(rows, [7, 7, 7], [0.0] * 3, version=4) == [a]
    assert a.finish_reason == "length" and a.versions == [3, 4] and b.output_ids == [EOS]


def test_ignore_eos_runs_past_eos_to_the_length_but_stop_ids_still_stop():
    s = Scheduler(max_batch=4, eos_token_id=EOS, max_context=64)
    a = Sequence(prompt_ids=[5], sampling=Sampling(max_new_tokens=3, ignore_eos=True))
    b = Sequence(prompt_ids=[5], sampling=Sampling(max_new_tokens=3, ignore_eos=True, stop_token_ids=(9,)))
    for x in (a, b):
        s.add(x)
    rows = s.schedule().rows
    assert s.postprocess(rows, [EOS, EOS], [0.0] * 2, version=0) == []
    assert s.postprocess(rows, [EOS, 9], [0.0] * 2, version=0) == [b] and b.finish_reason == "stop"
    assert s.postprocess([a], [EOS], [0.0], version=0) == [a]
    assert a.finish_reason == "length" and a.output_ids == [EOS] * 3


def test_ignore_eos_must_be_a_bool():
    with pytest.raises(ValueError, match="ignore_eos"):
        Sampling(ignore_eos=1)  # type: ignore[arg-type]


def test_weight_update_forces_a_rebuild():
    s = Scheduler(max_batch=2, eos_token_id=EOS, max_context=64)
    s.add(seq())
    rows = s.schedule().rows
    s.postprocess(rows, [7], [0.0], version=0)
    s.invalidate()
    assert s.schedule() == Step(rows, prefill=True)


def test_priority_requests_go_first_and_enter_a_full_queue_at_the_first_free_slot():
    s = Scheduler(max_batch=4, eos_token_id=EOS, max_context=64, refill_fraction=0.5)
    batch = [seq() for _ in range(4)]
    queued = [seq() for _ in range(3)]
    for x in batch + queued:
        s.add(x)
    rows = s.schedule().rows
    assert rows == batch
    s.postprocess(rows, [EOS, 7, 7, 7], [0.0] * 4, version=0)  # one slot frees up
    assert s.schedule().new == 0, "one free slot is below the refill threshold for ordinary work"
    urgent = seq(priority=True)
    s.add(urgent)
    step = s.schedule()
    assert step == Step([*batch[1:], urgent], prefill=False, keep=(1, 2, 3), new=1), \
        "the finished row leaves the cache, the urgent one is prefilled alone; running rows are not re-prefilled"
    assert not any(q in step.rows for q in queued)
    assert s.num_waiting == 3


def test_abort_all_finishes_everything_and_prompt_too_long_names_the_field():
    s = Scheduler(max_batch=1, eos_token_id=EOS, max_context=8)
    a, b, c = seq(), seq(), seq(priority=True)
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    aborted = s.abort_all()
    assert set(aborted) == {a, b, c} and all(x.finish_reason == "abort" for x in aborted)
    assert not s.has_work()
    with pytest.raises(ValueError, match="prompt_ids"):
        s.add(seq(prompt=range(8)))


def test_abort_of_a_waiting_sequence_takes_it_out_of_its_queue_now():
    s = Scheduler(max_batch=1, eos_token_id=EOS, max_context=64)
    a, b, c = seq(), seq(), seq(priority=True)
    for x in (a, b, c):
        s.add(x)
    assert s.abort(b) and s.abort(c), "waiting: finished at once, the caller reports it"
    assert (b.status, b.finish_reason, c.finish_reason) == (Status.FINISHED, "abort", "abort")
    assert s.num_waiting == 1 and not s.abort(b), "a finished sequence is left alone"
    assert s.schedule() == Step([a], prefill=True)


def test_abort_of_a_running_sequence_ends_it_at_the_next_postprocess_and_frees_its_slot():
    s = Scheduler(max_batch=2, eos_token_id=EOS, max_context=64, refill_fraction=0.5)
    a, b, queued = seq(max_new_tokens=10), seq(max_new_tokens=10), seq()
    for x in (a, b, queued):
        s.add(x)
    rows = s.schedule().rows
    s.postprocess(rows, [7, 7], [0.0] * 2, version=0)
    assert not s.abort(a) and a.status is Status.RUNNING, "running: finished by the next step"
    assert not s.abort(a), "aborting twice is one abort"
    step = s.schedule()
    rows = step.rows
    assert rows == [a, b] and not step.prefill
    assert s.postprocess(rows, [8, 8], [0.0] * 2, version=0) == [a]
    assert a.finish_reason == "abort" and a.output_ids == [7] and a.logprobs == [0.0] and a.versions == [0]
    assert b.output_ids == [7, 8] and not s.aborting
    step = s.schedule()
    rows = step.rows
    assert step == Step([b, queued], prefill=False, keep=(1,), new=1), "the freed slot takes the waiting sequence"
    assert s.postprocess(rows, [9, 9], [0.0] * 2, version=0) == [] and a.output_ids == [7]


def test_abort_of_a_finished_sequence_changes_nothing():
    s = Scheduler(max_batch=2, eos_token_id=EOS, max_context=64)
    a = seq()
    s.add(a)
    rows = s.schedule().rows
    assert s.postprocess(rows, [EOS], [0.0], version=0) == [a]
    assert not s.abort(a) and a.finish_reason == "stop" and not s.aborting


def test_half_finished_batch_is_compacted_without_a_prefill():
    s = Scheduler(max_batch=4, eos_token_id=EOS, max_context=64)
    rows = [seq(max_new_tokens=10) for _ in range(4)]
    for x in rows:
        s.add(x)
    s.postprocess(s.schedule().rows, [EOS, 7, 7, 7], [0.0] * 4, version=0)
    assert s.schedule() == Step(rows, prefill=False, keep=(0, 1, 2, 3), new=0), "one finished row of four stays"
    s.postprocess(rows, [7, EOS, 7, 7], [0.0] * 4, version=0)
    assert s.schedule() == Step(rows[2:], prefill=False, keep=(2, 3), new=0), "half finished: dropped, no prefill"


def test_when_every_row_finished_the_next_batch_is_a_fresh_prefill():
    s = Scheduler(max_batch=2, eos_token_id=EOS, max_context=64)
    a, later = seq(), seq()
    s.add(a)
    s.postprocess(s.schedule().rows, [EOS], [0.0], version=0)
    s.add(later)
    assert s.schedule() == Step([later], prefill=True)
