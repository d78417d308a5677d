"""The model the planner sizes: a Hugging Face config.json (Qwen2, Qwen3, Llama, Qwen3-MoE) read into the
weight exchange's ModelSpec, with every field it needs checked (ValueError naming the field)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError
from services.weight_exchange.client.layouts.model import ModelSpec

REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class PlannedModel:
    spec: ModelSpec
    experts_per_token: int = 0   # MoE top-k (0: dense)

    @property
    def q_size(self) -> int:
        return self.spec.num_heads * self.spec.head_dim

    @property
    def kv_size(self) -> int:
        return self.spec.num_kv_heads * self.spec.head_dim


def read_config(model_dir: str | pathlib.Path) -> dict[str, Any]:
    path = pathlib.Path(model_dir)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FieldError("model", f"no config.json at {path}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise FieldError("model", f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise FieldError("model", f"{path} does not hold a JSON object")
    return config


def planned_model(config: Mapping[str, Any]) -> PlannedModel:
    """ValueError naming the config.json field that is missing or out of range."""
    for name in REQUIRED:
        _positive(config, name, required=True)
    for name in ("num_key_value_heads", "head_dim", "intermediate_size", "num_experts", "moe_intermediate_size",
                 "num_experts_per_tok"):
        _positive(config, name, required=False)
    heads, kv = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or config["num_attention_heads"])
    if heads % kv:
        raise FieldError("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    if not config.get("head_dim") and int(config["hidden_size"]) % heads:
        raise FieldError("head_dim", f"missing, and hidden_size {config['hidden_size']} is not a multiple of "
                         f"num_attention_heads {heads}")
    spec = ModelSpec.from_hf_config(dict(config))
    if spec.num_experts:
        if not spec.moe_intermediate_size:
            raise FieldError("moe_intermediate_size", "needed when num_experts > 0")
        top_k = int(config.get("num_experts_per_tok") or 0)
        if not 1 <= top_k <= spec.num_experts:
            raise FieldError("num_experts_per_tok", f"must be in [1, {spec.num_experts}], got {top_k}")
        return PlannedModel(spec, top_k)
    if not spec.intermediate_size:
        raise FieldError("intermediate_size", "missing or 0")
    return PlannedModel(spec)


def load_model(model_dir: str | pathlib.Path) -> PlannedModel:
    return planned_model(read_config(model_dir))


def _positive(config: Mapping[str, Any], name: str, *, required: bool) -> None:
    value = config.get(name)
    if value is None:
        if required:
            raise FieldError(name, "missing from config.json")
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (required and value == 0):
        raise FieldError(name, f"must be a {'positive' if required else 'non-negative'} integer, got {value!r}")
