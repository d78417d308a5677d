"""The gateway's one typed config object; every knob has a default that works locally."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

DEV_ADMIN_KEY = "meshrl-dev-admin-key"


def _admin_key_from_env() -> str:
    return os.environ.get("MESHRL_ADMIN_KEY") or DEV_ADMIN_KEY


@dataclasses.dataclass(kw_only=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    admin_key: str = dataclasses.field(default_factory=_admin_key_from_env, repr=False)
    model_name: str = "meshrl-policy"           # reported by /v1/models and in responses; requests may name any model

    # back-pressure: while the engine is paused or a new group finds the staleness budget spent, wait this long, then 429
    max_wait_s: float = 30.0
    retry_after_s: float = 1.0                  # sent as Retry-After (and retry-after-ms) on 429
    poll_interval_s: float = 0.005              # how often a waiting request re-checks pause / budget
    stream_interval_s: float = 0.02             # how often streamed text is read from sequences in flight
    request_timeout_s: float = 600.0            # generation longer than this is answered 504 and not recorded

    # sessions and export
    export_mode: Literal["session", "interaction"] = "session"
    turn_discount: float = 1.0                  # reward of turn t = r_t + turn_discount * reward of turn t+1
    idle_timeout_s: float = 3600.0              # sessions without a request for this long end on their own
    reap_interval_s: float = 10.0
    max_sessions: int = 4096                    # active sessions; start_session beyond this is 429
    publish_timeout_s: float = 10.0             # end_session waits this long for the export to be published
    replay_ttl_s: float = 600.0                 # how long a finished request can be replayed to an SDK retry
    ended_ttl_s: float = 600.0                  # ended sessions answer 409 (then 401) for this long
    idempotency_ttl_s: float = 600.0

    # requests
    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    default_max_tokens: int | None = None       # None: up to the engine's context limit
    max_tokens_cap: int | None = None           # upper bound on any request's max_tokens (bounds rollout length)
    max_context: int | None = None              # None: the engine's own limit
    reject_unknown_params: bool = True          # False: unknown request fields are ignored instead of 400
    extra_stop_tokens: list[str] = dataclasses.field(default_factory=list)
    allow_admin_requests: bool = True           # the admin key may call model routes; nothing is recorded

    def __post_init__(self) -> None:
        if self.export_mode not in ("session", "interaction"):
            raise ValueError(f"export_mode: expected 'session' or 'interaction', got {self.export_mode!r}")
        if not 0.0 <= self.turn_discount <= 1.0:
            raise ValueError(f"turn_discount: must be in [0, 1], got {self.turn_discount}")
        for name in ("max_wait_s", "idle_timeout_s", "poll_interval_s", "stream_interval_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if not self.admin_key:
            raise ValueError("admin_key: must not be empty")

    @property
    def uses_dev_admin_key(self) -> bool:
        return self.admin_key == DEV_ADMIN_KEY
