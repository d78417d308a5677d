"""Images in agents' messages (OpenAI ``image_url`` parts with data URLs, Anthropic base64 ``image`` blocks) for a
vision-language policy.

Parsing keeps each image's bytes on its message and puts ``IMAGE_MARK`` (a private-use character that text parts may
not contain) where it stood in the content. Rendering turns the mark into the model's image token; encoding repeats
that token once per vision patch, as the model's processor does (``image_seq_length`` placeholders per image: the
LLaVA family); the engine replaces the placeholders by the images' features. The gateway fetches nothing: an
``http(s)`` image URL is refused, naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from services.common.image_data import ImageDataError, decode_base64, decode_data_url
from services.rollout.gateway.errors import bad_request, unsupported

IMAGE_MARK = "\ue000"


def check_text(text: str, path: str) -> str:
    if IMAGE_MARK in text:
        raise bad_request(path, "holds U+E000, which this gateway reserves for image positions")
    return text


def from_data_url(url: str, path: str) -> bytes:
    """An OpenAI ``image_url.url``: a base64 data URL of an image."""
    if not isinstance(url, str):
        raise bad_request(path, "expected a string URL")
    return _checked(lambda: decode_data_url(url), path)


def from_base64_source(source: dict, path: str) -> bytes:
    """An Anthropic image block's ``source`` ({type: base64, media_type, data})."""
    if not isinstance(source, dict):
        raise bad_request(path, "expected an object")
    if source.get("type") != "base64":
        raise unsupported(f"{path}.type", "only base64 image sources are supported (the gateway fetches nothing)")
    data = source.get("data")
    if not isinstance(data, str):
        raise bad_request(f"{path}.data", "expected a base64 string")
    return _checked(lambda: decode_base64(data, source.get("media_type") or ""), f"{path}.data")


def _checked(decode: Callable[[], bytes], path: str) -> bytes:
    try:
        return decode()
    except ImageDataError as exc:
        raise (unsupported if exc.unsupported else bad_request)(path, str(exc)) from exc


def expand(ids: list[int], token: int, per_image: int) -> list[int]:
    """Each image token as ``per_image`` placeholders."""
    if token not in ids:
        return ids
    out: list[int] = []
    for t in ids:
        out.extend([t] * per_image if t == token else (t,))
    return out


@dataclasses.dataclass(frozen=True)
class Vision:
    """What the gateway needs of a vision-language policy: its image token (text and id), the placeholders per image,
    encoded images -> pixels (the model's image processor), and where exported images are stored (None: nowhere, a
    gateway without a bus)."""
    token_text: str
    token_id: int
    per_image: int
    pixels: Callable[[list[bytes]], Any]
    store: Any = None
