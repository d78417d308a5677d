"""Which samples of an online batch the offline objectives train on. Pure tensor code, no I/O.

- SFT (rejection-sampling fine-tuning): every sample whose reward exceeds a threshold.
- DPO (online pairs): in each prompt group, the highest-reward sample is chosen over the lowest;
  a group whose rewards are all equal (a tie) gives no pair. The first sample wins among equals.
"""

from __future__ import annotations

import torch


def sft_rows(rewards: torch.Tensor, min_reward: float) -> torch.Tensor:
    """long[K]: rows with reward > min_reward, in batch order."""
    return torch.nonzero(rewards > min_reward).squeeze(-1)


def dpo_pairs(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen long[P], rejected long[P]): one pair per group with distinct rewards, in group order."""
    chosen, rejected = [], []
    for g in torch.unique(group_ids).tolist():
        rows = torch.nonzero(group_ids == g).squeeze(-1)
        r = rewards[rows]
        hi, lo = int(torch.argmax(r)), int(torch.argmin(r))  # first occurrence of the max / min
        if r[hi] > r[lo]:
            chosen.append(int(rows[hi]))
            rejected.append(int(rows[lo]))
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)
