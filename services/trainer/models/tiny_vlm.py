"""Pure builders for a tiny vision-language model of a real Hugging Face architecture (no I/O, no downloads).

LLaVA (``LlavaForConditionalGeneration``): a SigLIP vision tower, a two-layer projector, and the tiny Qwen3 as the
language model, with the character tokenizer plus an ``<image>`` token. The processor (``LlavaProcessor`` over
``SiglipImageProcessorPil``) expands each ``<image>`` in a prompt into ``image_tokens`` placeholders, one per
vision patch, whose embeddings the model replaces by the projected patch features. Positions stay 1-D (unlike
Qwen2-VL's M-RoPE), so the embedded engine's left-padded KV cache and the trainer's packing work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers

from services.trainer.models.tiny_qwen3 import IM_END, IM_START, TinyQwen3Config, build_tokenizer, padded_vocab_size

IMAGE_TOKEN = "<image>"


def build_vlm_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The tiny model's character tokenizer with ``<image>`` as one more special token."""
    tok = build_tokenizer()
    specials = [IM_START, IM_END, IMAGE_TOKEN]
    tok.add_special_tokens({"additional_special_tokens": specials})
    return tok


@dataclass
class TinyVLMConfig:
    image_size: int = 32
    patch_size: int = 8
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    text: TinyQwen3Config = field(default_factory=lambda: TinyQwen3Config(num_hidden_layers=2))

    @property
    def image_tokens(self) -> int:
        """Placeholders per image: one per patch (SigLIP has no CLS token)."""
        return (self.image_size // self.patch_size) ** 2

    def llava_config(self, tokenizer) -> transformers.LlavaConfig:
        vision = transformers.SiglipVisionConfig(
            hidden_size=self.vision_hidden, intermediate_size=2 * self.vision_hidden,
            num_hidden_layers=self.vision_layers, num_attention_heads=self.vision_heads,
            image_size=self.image_size, patch_size=self.patch_size, num_channels=3)
        text = self.text.qwen3_config(padded_vocab_size(tokenizer), tokenizer.eos_token_id)
        return transformers.LlavaConfig(
            vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
            vision_feature_select_strategy="full", vision_feature_layer=-1, projector_hidden_act="gelu",
            image_seq_length=self.image_tokens, tie_word_embeddings=True)

    def build(self, tokenizer) -> transformers.PreTrainedModel:
        """A freshly initialised float32 LlavaForConditionalGeneration (seed torch before calling)."""
        model = transformers.LlavaForConditionalGeneration(self.llava_config(tokenizer)).to(torch.float32)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.eos_token_id
        return model

    def processor(self, tokenizer) -> transformers.ProcessorMixin:
        """Images to normalised pixels at ``image_size``; each ``<image>`` in a text to ``image_tokens`` tokens."""
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

        images = SiglipImageProcessorPil(size={"height": self.image_size, "width": self.image_size},
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3)
        return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=self.patch_size,
                                           vision_feature_select_strategy="full", image_token=IMAGE_TOKEN,
                                           num_additional_image_tokens=0)
