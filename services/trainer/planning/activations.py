"""Activation bytes of one micro-batch at its forward peak.

Hugging Face models (torch / fsdp2 backends, sdpa attention): the tensors autograd saves per decoder layer,
counted with saved-tensor hooks on Qwen3 / Llama layers (float32, and bfloat16 autocast where norms stay
float32 and every linear casts its input), plus the policy head as step.py runs it: the logits [T, V]
alive, token_logp's log-softmax saved for backward, and the no-grad entropy's three [T, V] float32
temporaries (log-softmax, exp, product) at the same time.

Megatron (local layer spec, no sequence parallelism, unfused attention): hidden-sized tensors replicated over
TP, attention / MLP intermediates and the attention scores divided by TP, and 1F1B keeping ``pp - stage``
micro-batches in flight on each stage. The head as meshrl's megatron backend runs it on the last stage: the
vocab-parallel logits gathered to the whole (padded) vocabulary on every TP rank, since the trainer's objectives
read them whole, then the log-softmax saved for backward and the no-grad entropy's exp and product (float32).
"""

from __future__ import annotations

import dataclasses

from services.trainer.planning.model import PlannedModel

ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Workload:
    tokens: int          # tokens in one micro-batch (one forward) on this rank
    seq_len: int         # the padded row length (rows = tokens / seq_len)
    dtype: str = "float32"
    lora_rank: int = 0

    @property
    def rows(self) -> int:
        return max(1, self.tokens // self.seq_len)


def hf_layer_bytes(m: PlannedModel, layer: int, w: Workload) -> int:
    """Bytes per token one Hugging Face decoder layer saves for backward."""
    s = m.spec
    h, q, kv, nh, nkv = s.hidden_size, m.q_size, m.kv_size, s.num_heads, s.num_kv_heads
    if w.dtype == "float32":
        floats = 6 * h + 2 + 4 * q + nh   # two RMSNorms (input, rsqrt, normalised, output); sdpa q, k, v, out, lse
        floats += 2 * q + nh + 2 * kv + nkv if s.qk_norm else 0
        if s.is_moe_layer(layer):
            floats += 2 * s.num_experts + m.experts_per_token * (2 * h + 4 * s.moe_intermediate_size)
        else:
            floats += 4 * s.intermediate_size   # gate, up, silu(gate), product
        extra = 4 * 7 * w.lora_rank
        return 4 * floats + extra
    # bf16 autocast: float32 norms, a bf16 cast of the norm output per consuming linear (q, k, v; gate, up)
    out = 26 * h + 8 + 8 * q + 4 * nh
    out += 6 * q + 4 * nh + 6 * kv + 4 * nkv if s.qk_norm else 0
    if s.is_moe_layer(layer):
        out += 8 * s.num_experts + m.experts_per_token * (4 * h + 8 * s.moe_intermediate_size)
    else:
        out += 8 * s.intermediate_size
    return out + 2 * 7 * w.lora_rank


def hf_activation_bytes(m: PlannedModel, w: Workload) -> dict[str, int]:
    """The parts of one policy forward's peak: decoder layers, embeddings / final norm / mask, the head."""
    s = m.spec
    t = w.tokens
    layers = sum(hf_layer_bytes(m, n, w) for n in range(s.num_layers)) * t
    item = ITEMSIZE[w.dtype]
    final_norm = 4 * (3 * s.hidden_size + 1) if w.dtype == "float32" else 10 * s.hidden_size + 4
    rope = 2 * w.seq_len * s.head_dim * 4
    mask = w.rows * w.seq_len * w.seq_len * item   # the padded batch's [B, 1, L, L] attention mask
    other = t * (8 + final_norm) + rope + mask
    # logits (model dtype) + saved log-softmax + entropy's log-softmax, exp, product (float32)
    head = t * s.vocab_size * (item + 16)
    return {"layers": layers, "other": other, "head": head}


def megatron_activation_bytes(m: PlannedModel, w: Workload, *, tp: int, etp: int, layers: tuple[int, ...],
                              first: bool, last: bool, in_flight: int, padded_vocab: int) -> dict[str, int]:
    s = m.spec
    b = ITEMSIZE[w.dtype]
    h, q, kv, nh = s.hidden_size, m.q_size, m.kv_size, s.num_heads
    per_layer = 0
    for n in layers:
        out = b * (4 * h + (4 * q + 2 * kv) // tp) + (4 + b) * nh * w.seq_len // tp   # + softmax probs
        out += b * 2 * (q + kv) // tp if s.qk_norm else 0
        if s.is_moe_layer(n):
            out += 4 * s.num_experts + m.experts_per_token * b * (h + 3 * s.moe_intermediate_size // etp)
        else:
            out += b * 3 * s.intermediate_size // tp   # fc1 output (gate, up), swiglu output
        per_layer += out
    t = w.tokens
    other = t * ((b * h + 8) if first else 0) + (t * 2 * b * h if last else 0)
    # the gathered logits [T, V_padded], then log-softmax (saved), exp and product over the real vocabulary
    head = t * (4 * padded_vocab + 12 * s.vocab_size) if last else 0
    return {"layers": per_layer * t * in_flight, "other": other, "head": head}
