"""Identifiers and clocks."""

from __future__ import annotations

import re
import time
import uuid

# ids that travel in Nats-Msg-Id headers (trajectory, work and group ids): visible ASCII, no spaces or line breaks
HEADER_ID = re.compile(r"[\x21-\x7e]{1,256}")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def now() -> float:
    return time.time()
