"""Pure builders for a tiny Qwen3 model and its character-level tokenizer (no I/O, no downloads).

Tokenizer: every ASCII character (0-127) is one token; any other character falls back to its UTF-8
bytes (``<0x80>``..``<0xFF>``), so arbitrary text round-trips. Special tokens: ``<|endoftext|>``
(eos and pad), ``<|im_start|>``, ``<|im_end|>``. A Qwen-style ChatML chat template (system, user,
assistant with tool calls, tool messages, tools list, generation prompt) is set on the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from tokenizers import Tokenizer, decoders, models

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# Qwen2.5/Qwen3-style ChatML template (without the thinking-mode extras). Tools are listed compactly as
# `name(param, ...)` instead of Qwen's JSON schemas: a character-level model with a 256-position budget
# cannot afford 600 characters of boilerplate per turn. Tool calls are Qwen's `<tool_call>` JSON.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- 'Tools:' }}"
    "{%- for tool in tools %}{%- set fn = tool['function'] if tool['function'] is defined else tool %}"
    "{{- ' ' + fn['name'] + '(' + ((fn['parameters'] or {}).get('properties') or {}) | list | join(', ') + ')' }}"
    "{%- endfor %}"
    "{{- '\\nCall one with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{%- if loop.first and not message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Character-level tokenizer over ASCII with UTF-8 byte fallback; ids 0-127 are ASCII codes."""
    vocab: dict[str, int] = {chr(i): i for i in range(128)}
    for byte in range(128, 256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    # BPE with no merges is a character-level model; byte_fallback covers non-ASCII characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, ignore_merges=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


@dataclass
class TinyQwen3Config:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    num_experts: int = 0              # > 0: a Qwen3-MoE model, every layer's MLP `num_experts` routed experts
    num_experts_per_tok: int = 2      # top-k routing, the k weights renormalised (Qwen3-MoE's norm_topk_prob)
    moe_intermediate_size: int = 0    # each expert's; 0: intermediate_size // num_experts_per_tok

    def qwen3_config(self, vocab_size: int, eos_token_id: int, pad_token_id: int | None = None) -> transformers.PretrainedConfig:
        moe = {}
        if self.num_experts:
            moe = dict(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size or self.intermediate_size // self.num_experts_per_tok,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
        return (transformers.Qwen3MoeConfig if self.num_experts else transformers.Qwen3Config)(
            **moe,
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.initializer_range,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id if pad_token_id is None else pad_token_id,
            use_cache=True,
            torch_dtype="float32",
        )

    def build(self, vocab_size: int, eos_token_id: int = 256, pad_token_id: int | None = None) -> transformers.PreTrainedModel:
        """A freshly initialised float32 Qwen3ForCausalLM, or Qwen3MoeForCausalLM with `num_experts` (seed torch
        before calling for determinism)."""
        config = self.qwen3_config(vocab_size, eos_token_id, pad_token_id)
        model_class = transformers.Qwen3MoeForCausalLM if self.num_experts else transformers.Qwen3ForCausalLM
        model = model_class(config).to(torch.float32)
        model.generation_config.eos_token_id = eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
        model.generation_config.bos_token_id = eos_token_id
        return model


def padded_vocab_size(tokenizer: transformers.PreTrainedTokenizerBase, multiple: int = 8) -> int:
    n = len(tokenizer)
    return (n + multiple - 1) // multiple * multiple
