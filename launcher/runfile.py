"""The run file is the user's: the launcher fills in only what it leaves unset (pure functions, no I/O).

Two kinds of value reach a service's config from the launcher:
- defaults (`fill`): the run's seed, dtype and device, the trainer's step count, `make up`'s gateway and context
  length...: a value the file sets stands;
- the stack's wiring (`check_wiring`): its ports and NATS URL, the run's folder, the credentials' files, the model
  directory from the top-level `model`. Peers, health checks and the report depend on the launcher's own values, so
  a file that sets one is refused with the field named, instead of being overwritten in silence.
"""

from __future__ import annotations

import copy

from services.common.errors import FieldError

# service section key -> what sets it instead
WIRING = {"nats_url": "the stack's nats-server (--nats for a cluster)",
          "grpc_address": "the stack's ports",
          "run_dir": "the run's folder (--name)",
          "wx_address": "the stack's ports",
          "reward_address": "the stack's ports",
          "model_path": "the run file's top-level `model`",
          "auth_token_file": "the run's credentials (<run>/secrets)",
          "auth_peers_file": "the run's credentials (<run>/secrets)",
          "nats_user": "the run's credentials (<run>/secrets)",
          "nats_password_file": "the run's credentials (<run>/secrets)"}
ROLLOUT_WIRING = {("gateway", "port"): "the stack's ports (the gateway's is 8000 under `make up`)",
                  ("engine", "model_path"): "the run file's top-level `model`"}


def fill(settings: dict | None, defaults: dict) -> dict:
    """A copy of `settings` with each key of `defaults` it leaves unset (absent or null) added; mappings on both
    sides are filled key by key, so a file's `engine: {max_batch: 8}` keeps its max_batch and gains the seed."""
    out = copy.deepcopy(settings) if settings else {}
    for key, default in defaults.items():
        mine = out.get(key)
        if mine is None:
            out[key] = copy.deepcopy(default)
        elif isinstance(mine, dict) and isinstance(default, dict):
            out[key] = fill(mine, default)
    return out


def check_wiring(service: str, section: dict | None, keys: list[str]) -> None:
    """ValueError naming the first of the launcher's wiring `keys` (and, for rollout, nested ones) the file sets."""
    section = section or {}
    for key in keys:
        if section.get(key) is not None:
            raise FieldError(f"services.{service}.{key}", f"set by the launcher from {WIRING[key]}; "
                             "leave it out of the run file")
    if service != "rollout":
        return
    for (outer, inner), source in ROLLOUT_WIRING.items():
        nested = section.get(outer)
        if isinstance(nested, dict) and nested.get(inner) is not None:
            raise FieldError(f"services.rollout.{outer}.{inner}", f"set by the launcher from {source}; "
                             "leave it out of the run file")


# `make up` (an unbounded stack in the background, with the agent gateway): its defaults for the run file
UP_DEFAULTS: dict[str, dict] = {"builder": {"total_steps": 0},                        # unbounded
               "trainer": {"optim": {"schedule": "constant"}},       # an unbounded run has no end to decay to
               "rollout": {"gateway_enabled": True,
                           "engine": {"max_context": 2048}}}         # agent prompts with tools are long
