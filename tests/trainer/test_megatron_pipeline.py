"""The pipeline forwards' pure parts: which minibatch rows a padded microbatch holds, and how the microbatches'
losses and stats combine into the minibatch's (the ranks' schedule itself: test_megatron_backend.py)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.megatron.pipeline import _combine, _real_rows


@pytest.mark.parametrize("start, rows, size, expected", [
    (0, 3, 5, [0, 1, 2]), (3, 3, 5, [3, 4]), (6, 3, 5, []),   # the last microbatch is all padding
    (2, 1, 2, []), (3, 1, 2, []),                             # fewer rows than microbatches
])
def test_a_microbatch_holds_the_rows_it_covers_and_padding_holds_none(start, rows, size, expected):
    assert _real_rows(start, rows, size).tolist() == expected


def test_microbatch_losses_sum_and_stats_average_by_loss_weight():
    # (weight, weighted loss, stats) per microbatch; None: a microbatch of padding only
    parts = [(3, 0.3, {"clip_fraction": 0.5, "ratio_max": 1.2}), None,
             (1, 0.1, {"clip_fraction": 0.1, "ratio_max": 1.5})]
    loss, stats = _combine(parts)
    assert loss == pytest.approx(0.4)
    assert stats["clip_fraction"] == pytest.approx((3 * 0.5 + 1 * 0.1) / 4)
    assert stats["ratio_max"] == 1.5
    assert _combine([None, None]) == (0.0, {})
    assert torch.is_tensor(_real_rows(0, 1, 1))
