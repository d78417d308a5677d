"""The gateway's one typed config object; every knob has a default that works locally.

The admin key: `admin_key` (config, or the environment's MESHRL_ADMIN_KEY); when neither is set, the key is
read from `admin_key_file` (default `<run_dir>/secrets/gateway_admin_key`) or, the first time, generated into
it (mode 0600). Only its path is ever shown; there is no public default key.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets
import time
from typing import Literal

from services.common.errors import FieldError

ADMIN_KEY_ENV = "MESHRL_ADMIN_KEY"
ADMIN_KEY_FILE_ENV = "MESHRL_ADMIN_KEY_FILE"
ADMIN_KEY_FILE = pathlib.Path("secrets") / "gateway_admin_key"   # under the run directory
MIN_ADMIN_KEY_CHARS = 12
# The old public development key: refused wherever it is configured. The name stays importable for callers that
# printed it; it now says where the generated key is.
PUBLIC_DEV_KEY = "meshrl-dev-admin-key"
FLOAT32_MAX = 3.4028234663852886e38  # rewards travel as protobuf float: anything larger becomes inf
DEV_ADMIN_KEY = f"(generated at start: <run_dir>/{ADMIN_KEY_FILE}; or set {ADMIN_KEY_ENV})"

# chat_template_kwargs a request may send: documented switches of the model's template, booleans only. Nothing
# that replaces the template or changes how it is applied is ever accepted.
TEMPLATE_KWARGS = ("enable_thinking",)
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "template", "tools", "documents", "messages", "conversation",
                                       "add_generation_prompt", "tokenize", "continue_final_message", "return_dict",
                                       "return_tensors", "return_assistant_tokens_mask", "truncation", "padding",
                                       "max_length", "tokenizer_kwargs"})


def _admin_key_from_env() -> str:
    return os.environ.get(ADMIN_KEY_ENV, "")


def _admin_key_file_from_env() -> str:
    return os.environ.get(ADMIN_KEY_FILE_ENV, "")


@dataclasses.dataclass(kw_only=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    admin_key: str = dataclasses.field(default_factory=_admin_key_from_env, repr=False)  # empty: the key file
    admin_key_file: str = dataclasses.field(default_factory=_admin_key_file_from_env)   # empty: <run_dir>/secrets/...
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
    publish_timeout_s: float = 10.0             # end_session waits this long for the bus to confirm the export, then 503
    publish_linger_s: float = 0.02              # an ended session of a larger group waits this long for its group-mates
                                                # to end, so they travel as one message (0: never waits)
    max_abs_reward: float = 1e6                 # set_reward and every exported (summed) reward stay within +-this
    max_trajectory_bytes: int = 0               # serialised trajectory over this: end_session 413 (0: the bus's own limit)
    replay_ttl_s: float = 600.0                 # how long a finished request can be replayed to an SDK retry
    ended_ttl_s: float = 600.0                  # ended sessions answer 409 (then 401) for this long
    idempotency_ttl_s: float = 600.0

    # bounds: every cache and queue; past one, a clear 429 (or 413 for a body)
    max_inflight: int = 1024                    # model requests being generated at once (all sessions)
    max_session_interactions: int = 1024        # recorded calls of one session; then 429 until it ends
    max_session_tokens: int = 4_000_000         # recorded prompt + completion ids of one session
    max_recorded_tokens: int = 64_000_000       # the same over every active session
    replay_max_entries: int = 16384             # remembered requests for SDK retries (oldest finished dropped)
    idempotency_max_entries: int = 16384        # start_session Idempotency-Keys remembered within their TTL
    max_pending_publish: int = 65536            # exported trajectories waiting for the bus; end_session 429 past it

    # requests
    max_body_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 64                    # nesting of a request body; deeper is 400
    offload_bytes: int = 32 * 1024              # bodies larger than this are parsed, rendered, tokenized off the loop
    heavy_concurrency: int = 4                  # such bodies (and count_tokens) handled at once
    heavy_queue: int = 64                       # waiting for a slot; beyond it 429
    max_n: int = 16
    default_max_tokens: int | None = None       # None: up to the engine's context limit
    max_tokens_cap: int | None = None           # upper bound on any request's max_tokens (bounds rollout length)
    max_context: int | None = None              # None: the engine's own limit
    reject_unknown_params: bool = True          # False: unknown request fields are ignored instead of 400
    template_kwargs: list[str] = dataclasses.field(default_factory=lambda: list(TEMPLATE_KWARGS))
    extra_stop_tokens: list[str] = dataclasses.field(default_factory=list)
    allow_admin_requests: bool = True           # the admin key may call model routes; nothing is recorded
    sessions_enabled: bool = True               # False: start_session is 403 (a frozen model's server: never trained)

    def __post_init__(self) -> None:
        if self.export_mode not in ("session", "interaction"):
            raise FieldError("export_mode", f"expected 'session' or 'interaction', got {self.export_mode!r}")
        if not 0.0 <= self.turn_discount <= 1.0:
            raise FieldError("turn_discount", f"must be in [0, 1], got {self.turn_discount}")
        for name in ("max_wait_s", "idle_timeout_s", "poll_interval_s", "stream_interval_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        if not 0.0 < self.max_abs_reward <= FLOAT32_MAX:
            raise FieldError("max_abs_reward", f"must be in (0, {FLOAT32_MAX:.8g}] (rewards travel as float32), "
                             f"got {self.max_abs_reward}")
        if not 0.0 <= self.publish_linger_s <= self.publish_timeout_s:
            raise FieldError("publish_linger_s", f"must be in [0, publish_timeout_s = {self.publish_timeout_s}], "
                             f"got {self.publish_linger_s}")
        if self.max_trajectory_bytes < 0:
            raise FieldError("max_trajectory_bytes", f"must be >= 0 (0: the bus's limit), got {self.max_trajectory_bytes}")
        if self.max_body_bytes < 1024:
            raise FieldError("max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")
        for name in ("max_inflight", "max_session_interactions", "max_session_tokens", "max_recorded_tokens",
                     "replay_max_entries", "idempotency_max_entries", "max_pending_publish", "max_json_depth",
                     "heavy_concurrency", "max_n", "max_sessions"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.heavy_queue < 0 or self.offload_bytes < 0:
            raise ValueError("heavy_queue, offload_bytes: must be >= 0")
        if self.admin_key:
            check_admin_key(self.admin_key)
        reserved = sorted(set(self.template_kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise FieldError("template_kwargs", f"{reserved} change how the template is applied; not allowed")


def check_admin_key(key: str) -> None:
    if key == PUBLIC_DEV_KEY or key == DEV_ADMIN_KEY:
        raise FieldError("admin_key", "the old public development key is refused; unset it to have one generated")
    if len(key) < MIN_ADMIN_KEY_CHARS:
        raise FieldError("admin_key", f"must be at least {MIN_ADMIN_KEY_CHARS} characters")
    if not key.isprintable() or any(c.isspace() for c in key):
        raise FieldError("admin_key", "must be printable characters without whitespace")


def admin_key_path(config: GatewayConfig, run_dir: str | os.PathLike | None = None) -> pathlib.Path:
    if config.admin_key_file:
        return pathlib.Path(config.admin_key_file)
    return pathlib.Path(run_dir or "runs/default") / ADMIN_KEY_FILE


def ensure_admin_key(config: GatewayConfig, run_dir: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Give `config` its admin key when none is configured: read the key file, or generate it there (0600).
    Returns the file (None: the key came from config or MESHRL_ADMIN_KEY). Never logs the key."""
    if config.admin_key:
        return None
    path = admin_key_path(config, run_dir)
    config.admin_key = read_or_create_key(path)
    return path


def read_or_create_key(path: pathlib.Path) -> str:
    """The key in `path`; created (0600, in a 0700 directory) with a fresh random key when missing. Several
    processes starting at once agree on one key (exclusive create; the losers read the winner's)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_key(path)
    key = "sk-meshrl-admin-" + secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    return key


def _read_key(path: pathlib.Path) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        try:
            os.chmod(path, 0o600)  # a key file others can read is tightened, not trusted as it is
        except OSError:
            # a read-only mount (a Kubernetes Secret: root-owned, readable by the pod's group) cannot be tightened;
            # it is trusted only when no other user may read it
            if mode & 0o007:
                raise FieldError("admin_key_file", f"{path} is readable by every user (mode {mode:o}) and cannot be "
                                 "tightened") from None
    for _ in range(100):  # a concurrent creator may not have written it yet
        key = path.read_text().strip()
        if key:
            check_admin_key(key)
            return key
        time.sleep(0.01)
    raise FieldError("admin_key_file", f"{path} is empty")
