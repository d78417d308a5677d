"""Encoded images as people hand them over, decoded and checked the same way wherever they arrive: base64 data URLs
and base64 strings in dataset rows (the builder) and in agents' messages (the gateway), raw bytes from files. No I/O:
nothing is ever fetched, an ``http(s)`` URL is refused."""

from __future__ import annotations

import base64
import binascii
import re

MAX_IMAGE_BYTES = 8 << 20   # one encoded image
MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
_DATA_URL = re.compile(r"data:(?P<type>[\w/+.-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,(?P<data>.*)", re.DOTALL)


class ImageDataError(ValueError):
    """Why an image was refused. ``unsupported``: well formed but not taken (a URL to fetch, a media type); otherwise
    malformed. Callers prefix the field."""

    def __init__(self, problem: str, unsupported: bool = False) -> None:
        super().__init__(problem)
        self.unsupported = unsupported


def decode_data_url(url: str) -> bytes:
    """The bytes of a ``data:image/<type>;base64,<data>`` URL."""
    if url.startswith(("http://", "https://")):
        raise ImageDataError("images are never fetched: send the image inline as a data:image/...;base64 URL",
                             unsupported=True)
    found = _DATA_URL.fullmatch(url)
    if found is None or not found["b64"]:
        raise ImageDataError("expected a data:image/<type>;base64,<data> URL")
    return decode_base64(found["data"], found["type"] or "")


def decode_base64(data: str, media_type: str) -> bytes:
    """The bytes of a base64 image of ``media_type`` (one of MEDIA_TYPES), at most MAX_IMAGE_BYTES."""
    if media_type not in MEDIA_TYPES:
        raise ImageDataError(f"media type {media_type or '(none)'!r} is not supported (one of {', '.join(MEDIA_TYPES)})",
                             unsupported=True)
    if len(data) > 4 * MAX_IMAGE_BYTES // 3 + 4:   # refused before decoding
        raise ImageDataError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageDataError(f"not valid base64 ({exc})") from exc
    return check_size(blob)


def check_size(blob: bytes) -> bytes:
    if not blob:
        raise ImageDataError("the image is empty")
    if len(blob) > MAX_IMAGE_BYTES:
        raise ImageDataError(f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    return blob
