"""Checkpoints in Hugging Face format (config.json, model.safetensors, tokenizer files), written atomically.

A resumable checkpoint also holds the trainer's full state (`meshrl_state.pt`: optimizer, schedule, RNG,
counters, ...) and its lineage (`meshrl_lineage.json`). Every checkpoint is written into a temporary
directory next to its target, each file fsynced, `manifest.json` (files, sizes, version) written last,
then renamed into place: a directory without a valid manifest is incomplete and never resumed from.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import uuid
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

MANIFEST = "manifest.json"
STATE = "meshrl_state.pt"
LINEAGE = "meshrl_lineage.json"


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | pathlib.Path, *,
                    version: int, state_dict: dict[str, torch.Tensor] | None = None,
                    state: dict[str, Any] | None = None, lineage: dict[str, Any] | None = None,
                    directories: dict[str, pathlib.Path] | None = None) -> pathlib.Path:
    """``state_dict`` (canonical names) replaces the model's own, e.g. merged LoRA weights of a peft base model;
    ``state`` (torch.save'd) makes the checkpoint resumable; ``lineage`` goes to ``meshrl_lineage.json``;
    ``directories`` (name -> a directory already written, e.g. megatron-core's distributed checkpoint) are moved in
    under those names, covered by the manifest like every other file."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        (tmp / "meshrl_version.json").write_text(json.dumps({"policy_version": version}))
        if lineage is not None:
            (tmp / LINEAGE).write_text(json.dumps({**lineage, "version": version}))
        if state is not None:
            torch.save(state, tmp / STATE)
        for name, written in (directories or {}).items():
            shutil.move(str(written), tmp / name)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        for name in files:
            _fsync(tmp / name)
        manifest = {"version": version, "files": {name: (tmp / name).stat().st_size for name in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)  # readers never see a half-written checkpoint
        _fsync(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_manifest(path: str | pathlib.Path) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint (every listed file present with its size), else None."""
    path = pathlib.Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        int(manifest["version"])
        if all((path / name).stat().st_size == size for name, size in files.items()):
            return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def complete_checkpoints(root: str | pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """(version, path) of the complete resumable checkpoints `root/v<N>`, oldest first."""
    found = []
    for path in pathlib.Path(root).glob("v*"):
        manifest = read_manifest(path) if path.is_dir() else None
        if manifest is not None and STATE in manifest["files"]:
            found.append((int(manifest["version"]), path))
    return sorted(found)


def latest_checkpoint(root: str | pathlib.Path) -> pathlib.Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: str | pathlib.Path, keep: int) -> list[pathlib.Path]:
    """Remove incomplete checkpoints and leftovers of interrupted writes under `root`, and all but the newest
    `keep` complete ones (0: keep all). Call only from the one process writing there. Returns what went."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return []
    newest = [path for _, path in complete_checkpoints(root)]
    newest = newest[-keep:] if keep else newest
    removed = remove_leftovers(root)
    for path in root.glob("v*"):
        if path.is_dir() and path not in newest:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_leftovers(parent: str | pathlib.Path, name: str = "") -> list[pathlib.Path]:
    """Remove what interrupted writes of checkpoint `parent/name` (any name when empty) left behind."""
    removed = []
    for path in pathlib.Path(parent).glob(f".{name or '*'}.*"):
        if ".tmp-" in path.name or ".old-" in path.name:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def read_state(path: str | pathlib.Path) -> dict[str, Any]:
    return torch.load(pathlib.Path(path) / STATE, map_location="cpu", weights_only=True)


def read_lineage(path: str | pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads((pathlib.Path(path) / LINEAGE).read_text())
    except (OSError, ValueError):
        return None


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
