"""A few hundred generated inputs per edge (`make fuzz` runs 10,000): no crash, no 5xx for a client's fault, no
other request's sequence aborted, nothing hung."""

from __future__ import annotations

import pytest

from bench.fuzz import run_target

CASES = {"gateway": 250, "prompts": 150, "traj.raw": 200, "traj.scored": 300, "batches": 300}


@pytest.mark.parametrize("target", list(CASES))
def test_fuzzed_inputs_are_refused_cleanly(target):
    tally = run_target(target, CASES[target], seed=1)
    line = tally.line()
    assert tally.cases == CASES[target], line
    assert (tally.crashes, tally.server_errors_for_client_faults, tally.unrelated_sequences_aborted, tally.hung) == \
        (0, 0, 0, 0), line
