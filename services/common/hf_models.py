"""Loading a Hugging Face model directory as a language model, text-only or vision-language, and turning encoded
images into the pixels its vision tower takes. Torch and transformers, imported by the services that run models."""

from __future__ import annotations

import io
import pathlib
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig

if TYPE_CHECKING:  # transformers' modeling module costs ~1 CPU-s to import: the builder only asks is_vision_language
    from transformers import PreTrainedModel


def is_vision_language(path: str | pathlib.Path) -> bool:
    """The directory holds a vision-language model (its config has a vision tower)."""
    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def load_lm(path: str | pathlib.Path, dtype: torch.dtype) -> PreTrainedModel:
    """A causal LM (``AutoModelForCausalLM``) or, for a vision-language model, ``AutoModelForImageTextToText``:
    both take ``input_ids`` and return next-token logits; the latter also takes ``pixel_values``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype)


def image_slots(model: PreTrainedModel) -> tuple[int, int] | None:
    """(image placeholder token id, placeholders per image) of a vision-language model; None for a text model."""
    config: Any = getattr(model, "config", None)  # test doubles of a model may have none
    if getattr(config, "vision_config", None) is None:
        return None
    return int(config.image_token_id), int(config.image_seq_length)


def image_embeds(model: PreTrainedModel, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                 images_per_row: torch.Tensor) -> torch.Tensor:
    """A vision-language model's input embeddings float[B, L, H] for these rows: the tokens' embeddings, with the
    first ``images_per_row[b] * placeholders per image`` placeholders of row b replaced by its images' projected
    features (``pixel_values`` holds every row's images in row order). A placeholder token the policy sampled later
    in a row is an ordinary token: the model's own forward would count it as an image and fail."""
    slots = image_slots(model)
    assert slots is not None, "image_embeds on a text model"
    token, per_image = slots
    embed: torch.nn.Module = model.get_input_embeddings()
    embeds = embed(input_ids)
    vision: Any = model  # get_image_features: LLaVA-family models' own method, unknown to PreTrainedModel's stubs
    features = vision.get_image_features(pixel_values=pixel_values.to(embeds.dtype))
    features = getattr(features, "pooler_output", features)
    features = torch.cat(list(features)) if isinstance(features, list | tuple) else features
    features = features.reshape(-1, embeds.shape[-1])
    placeholders = input_ids == token
    prompt = placeholders & (placeholders.cumsum(-1) <= (images_per_row.to(input_ids.device) * per_image)[:, None])
    if int(prompt.sum()) != features.shape[0]:
        raise ValueError(f"images: {features.shape[0]} image features for {int(prompt.sum())} placeholder tokens")
    return embeds.masked_scatter(prompt.unsqueeze(-1), features.to(embeds.dtype))


class Pixels:
    """Encoded images -> the float pixels [images, channels, height, width] a model's vision tower takes, through
    the model directory's own image processor."""

    def __init__(self, path: str | pathlib.Path) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(path)

    def __call__(self, blobs: list[bytes]) -> torch.Tensor:
        from PIL import Image, UnidentifiedImageError

        images = []
        for i, blob in enumerate(blobs):
            try:
                images.append(Image.open(io.BytesIO(blob)).convert("RGB"))
            except (UnidentifiedImageError, OSError) as exc:
                raise ValueError(f"images[{i}]: not a readable image ({exc})") from exc
        return self.processor(images=images, return_tensors="pt")["pixel_values"]
