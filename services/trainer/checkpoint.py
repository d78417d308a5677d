"""Checkpoints in Hugging Face format: config.json, model.safetensors, tokenizer files."""

from __future__ import annotations

import json
import pathlib

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | pathlib.Path, *,
                    version: int, state_dict: dict[str, torch.Tensor] | None = None) -> pathlib.Path:
    """``state_dict`` (canonical names) replaces the model's own, e.g. merged LoRA weights of a peft base model."""
    out = pathlib.Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    (tmp / "meshrl_version.json").write_text(json.dumps({"policy_version": version}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # readers never see a half-written checkpoint
    return out
