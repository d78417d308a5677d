"""The vision tests' tiny LLaVA (random weights, built in a temporary directory) and pictures to show it."""

from __future__ import annotations

import pytest
import torch

from services.builder.datasets import shapes
from services.trainer.models.tiny_vlm import TinyVLMConfig, build_vlm_tokenizer


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = TinyVLMConfig()
    tokenizer = build_vlm_tokenizer()
    out = tmp_path_factory.mktemp("tiny-vlm")
    config.build(tokenizer).save_pretrained(out)
    config.processor(tokenizer).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def pictures() -> list[bytes]:
    return [t.images[0] for t in shapes.generate_split("train", 3, seed=0)]
