"""Helpers of the vision tests: the shapes prompt through the model's processor, pictures as the engine takes them."""

from __future__ import annotations

import io

from PIL import Image

from services.builder.datasets import shapes
from services.common.hf_models import Pixels
from services.common.images import ref_of
from services.rollout.engines.sequence import Images


def prompt_ids(vlm_dir: str, blob: bytes) -> list[int]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    image = Image.open(io.BytesIO(blob)).convert("RGB")
    return list(processor(text=[f"<image>{shapes.QUESTION}"], images=[image], add_special_tokens=False)["input_ids"][0])


def images_of(vlm_dir: str, blobs: list[bytes]) -> Images:
    return Images(key=tuple(ref_of(b).sha256 for b in blobs), pixel_values=Pixels(vlm_dir)(blobs))


