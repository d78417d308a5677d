"""Checkpoints in Hugging Face format: config.json, model.safetensors, tokenizer files."""

from __future__ import annotations

import json
import pathlib

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | pathlib.Path, *,
                    version: int) -> pathlib.Path:
    out = pathlib.Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "meshrl_version.json").write_text(json.dumps({"policy_version": version}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # readers never see a half-written checkpoint
    return out
