"""The builder's recovery arithmetic, directly: what a restarted builder counts from the ledger and the batches."""

from __future__ import annotations

from services.builder.accounting import RunEnd, recount
from services.builder.admission import OnlineBudget, StalenessBudget
from services.builder.evaluation import EvalRound
from services.builder.ledger import NO_VARIANCE, Batched, Dropped, LedgerState


def ledger() -> LedgerState:
    return LedgerState(issued=7, refills=3, dropped={
        "g-2": Dropped("g-2", "stale", "workflow", 8),
        "g-3": Dropped("g-3", NO_VARIANCE, "workflow", 8),
        "s-1": Dropped("s-1", "dead_letter:reward", "gateway", 4)})


BATCHES = [Batched(0, ("g-0", "g-1"), 16), Batched(3, ("g-4",), 8)]   # 1 and 2 lost to BATCHES' limits


def test_counts_from_the_ledger_and_the_batches_that_survive():
    counts = recount(ledger(), BATCHES)
    assert counts.batches_published == 4, "the index after the highest, not the count of what survives"
    assert counts.consumed_groups == {"g-0", "g-1", "g-4", "g-2", "g-3", "s-1"}
    assert (counts.received, counts.dropped_stale, counts.groups_dropped) == (16 + 8 + 20, 12, 2)
    assert (counts.batched_groups, counts.dropped_workflow, counts.filtered, counts.dropped_online) == (3, 2, 1, 1)
    assert counts.refills == 1, "never more refills than filtered groups"
    assert counts.in_flight() == 7 - 3 - 2
    assert counts.open_groups() == ["g-5", "g-6"]


def test_the_budgets_restart_where_they_stood():
    counts = recount(ledger(), BATCHES)
    budget = StalenessBudget(batch_size=2, max_staleness=1)
    counts.restore(budget)
    assert (budget.accepted, budget.dropped, budget.filtered, budget.refills, budget.in_flight) == (3, 2, 1, 1, 2)
    online = OnlineBudget(batch_size=2, max_staleness=1)
    counts.restore_online(online)
    assert (online.released, online.arrived) == (1, 3 + 2 + 1)


def test_a_fresh_ledger_counts_nothing():
    counts = recount(LedgerState(), [])
    assert counts.batches_published == 0 and counts.received == 0 and counts.open_groups() == []


def test_run_end_waits_for_the_final_checkpoint_or_its_timeout_and_goes_out_once():
    end = RunEnd(checkpoint_timeout_s=30.0)
    assert end.due(at=0.0) is None            # nothing asked
    end.ask(5, {"eval_accuracy": 0.5}, at=100.0)
    end.ask(6, {}, at=101.0)                  # a second ask keeps the first
    assert end.due(at=129.0) is None          # no final checkpoint yet, still inside the wait
    assert end.due(at=130.0) == (5, {"eval_accuracy": 0.5}, False) and end.waited(130.0) == 30.0
    end.checkpointed = True
    assert end.due(at=100.5) == (5, {"eval_accuracy": 0.5}, True)   # the checkpoint is out: at once
    end.seen = True
    assert end.due(at=200.0) is None          # on the stream already


def test_a_completed_final_round_without_run_end_is_an_interrupted_end():
    end = RunEnd(checkpoint_timeout_s=1.0)
    assert not end.interrupted()
    end.final_round = EvalRound(round_id=2, version=9, expected=1, final=True)
    assert not end.interrupted()              # issued, not complete
    end.final_round.rewards["t"] = 1.0
    assert end.interrupted()
    end.seen = True
    assert not end.interrupted()
