"""Per-update secrets on the weight plane, issued by the coordinator.

Every agent makes a random key when its process starts and gives it only to the coordinator (in Register). For
each update the coordinator draws a random `sync_id` and
- signs every receiver's ApplyRequest with that receiver's key: a receiver applies nothing the coordinator did
  not send (not another caller's sender endpoints, versions or transfers), and no request twice;
- issues, per (sender, receiver), a pull ticket made with the sender's key, bound to the receiver, the version
  and the sync_id: the sender's data server serves only a pull that presents it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.errors import FieldError


def new_key() -> bytes:
    return secrets.token_bytes(32)


def new_sync_id() -> str:
    return secrets.token_hex(16)


def parse_key(text: str) -> bytes:
    """A key as sent in RegisterRequest.rank_key (hex); ValueError naming the field when malformed."""
    try:
        key = bytes.fromhex(text)
    except ValueError as exc:
        raise FieldError("rank_key", "not hex") from exc
    if len(key) < 16:
        raise FieldError("rank_key", "shorter than 16 bytes")
    return key


def ticket(sender_key: bytes, receiver: str, version: int, sync_id: str) -> str:
    message = f"meshrl-pull\n{receiver}\n{version}\n{sync_id}".encode()
    return hmac.new(sender_key, message, hashlib.sha256).hexdigest()


def ticket_ok(sender_key: bytes, presented: object, receiver: str, version: int, sync_id: object) -> bool:
    if not isinstance(presented, str) or not isinstance(sync_id, str) or not sync_id:
        return False
    return hmac.compare_digest(ticket(sender_key, receiver, version, sync_id), presented)


def _apply_digest(receiver_key: bytes, request: wx_pb2.ApplyRequest) -> str:
    unsigned = wx_pb2.ApplyRequest()
    unsigned.CopyFrom(request)
    unsigned.signature = ""
    return hmac.new(receiver_key, unsigned.SerializeToString(deterministic=True), hashlib.sha256).hexdigest()


def sign_apply(receiver_key: bytes, request: wx_pb2.ApplyRequest) -> None:
    """Set `request.signature` (call last: it covers every other field)."""
    request.signature = _apply_digest(receiver_key, request)


def apply_signed(receiver_key: bytes, request: wx_pb2.ApplyRequest) -> bool:
    return bool(request.signature) and bool(request.sync_id) and hmac.compare_digest(
        _apply_digest(receiver_key, request), request.signature)
