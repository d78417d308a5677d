"""Model shapes in the canonical (Hugging Face checkpoint) namespace, from a config.json or a built-in name.

Canonical names are the checkpoint's: split q/k/v and gate/up projections, per-expert MoE weights
`mlp.experts.{e}.{gate,up,down}_proj.weight`, global layer numbers, the vocabulary without padding.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "Qwen3MoeForCausalLM": "qwen3_moe", "MistralForCausalLM": "llama"}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # q/k/v_proj.bias (Qwen2 always; Llama / Qwen3 with attention_bias)
    o_bias: bool = False            # o_proj.bias (Llama / Qwen3 / Qwen3-MoE with attention_bias; never Qwen2)
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    dtype: str = "bfloat16"

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers and \
            (layer + 1) % max(1, self.decoder_sparse_step) == 0

    def layer_tensors(self, layer: int) -> dict[str, tuple[int, ...]]:
        h, hd = self.hidden_size, self.head_dim
        p = f"model.layers.{layer}."
        out: dict[str, tuple[int, ...]] = {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (self.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (self.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": (self.num_kv_heads * hd, h),
        }
        if self.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (self.num_heads * hd,)
            out[p + "self_attn.k_proj.bias"] = (self.num_kv_heads * hd,)
            out[p + "self_attn.v_proj.bias"] = (self.num_kv_heads * hd,)
        out[p + "self_attn.o_proj.weight"] = (h, self.num_heads * hd)
        if self.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if self.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if self.is_moe_layer(layer):
            i = self.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (self.num_experts, h)
            for e in range(self.num_experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (i, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (i, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, i)
        else:
            i = self.intermediate_size
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
            out[p + "mlp.down_proj.weight"] = (h, i)
        return out

    def canonical(self) -> dict[str, tuple[int, ...]]:
        """Every canonical tensor and its shape, in checkpoint order."""
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, self.hidden_size)}
        for layer in range(self.num_layers):
            out.update(self.layer_tensors(layer))
        out["model.norm.weight"] = (self.hidden_size,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return out

    @property
    def lm_head_name(self) -> str:
        return "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"

    def num_params(self) -> int:
        total = 0
        for shape in self.canonical().values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike, dtype: str | None = None) -> ModelSpec:
        """From a Hugging Face config (dict, config.json path, or a directory holding one)."""
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        arch = MODEL_TYPES.get(config.get("model_type", ""))
        if arch is None:
            archs = [ARCHS[a] for a in config.get("architectures", []) if a in ARCHS]
            if not archs:
                raise FieldError("model", f"unsupported model_type {config.get('model_type')!r} "
                                 f"(supported: {', '.join(sorted(MODEL_TYPES))})")
            arch = archs[0]
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            arch=arch, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size", 0)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(config.get("attention_bias", False)),   # Qwen2's o_proj has none
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            num_experts=int(config.get("num_experts") or config.get("num_local_experts") or 0)
            if arch == "qwen3_moe" else 0,
            moe_intermediate_size=int(config.get("moe_intermediate_size", 0) or 0),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers", []) or ()),
            dtype=dtype or _dtype(config),
        )


def _dtype(config: Mapping[str, Any]) -> str:
    value = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return value.removeprefix("torch.")


BUILTIN: dict[str, dict[str, Any]] = {
    # published Hugging Face configs (the fields that shape the weights)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                            moe_intermediate_size=1536, num_experts=128, tie_word_embeddings=False),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                       tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                         tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         tie_word_embeddings=True),
    # small configs for tests
    "tiny-qwen3": dict(model_type="qwen3", vocab_size=264, hidden_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=384,
                       tie_word_embeddings=True, torch_dtype="float32"),
    "tiny-qwen2": dict(model_type="qwen2", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       tie_word_embeddings=False, torch_dtype="float32"),
    "tiny-llama-gqa9": dict(model_type="llama", vocab_size=384, hidden_size=144, num_hidden_layers=2,
                            num_attention_heads=9, num_key_value_heads=3, intermediate_size=192,
                            tie_word_embeddings=True, torch_dtype="float32"),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", vocab_size=300, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                           moe_intermediate_size=32, num_experts=8, tie_word_embeddings=False,
                           torch_dtype="float32"),
}


def model_spec(name_or_path: str, dtype: str | None = None) -> ModelSpec:
    """A built-in name (see BUILTIN) or a path to a Hugging Face config.json / model directory."""
    if name_or_path in BUILTIN:
        return ModelSpec.from_hf_config(BUILTIN[name_or_path], dtype)
    if os.path.exists(name_or_path):
        return ModelSpec.from_hf_config(name_or_path, dtype)
    raise FieldError("model", f"{name_or_path!r} is neither a built-in ({', '.join(BUILTIN)}) nor a config path")
