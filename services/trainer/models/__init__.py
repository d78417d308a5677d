"""Model and tokenizer builders."""

from services.trainer.models.tiny_qwen3 import TinyQwen3Config, build_tokenizer, padded_vocab_size

__all__ = ["TinyQwen3Config", "build_tokenizer", "padded_vocab_size"]
