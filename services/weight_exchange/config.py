"""The weight-exchange service's configuration (env: MESHRL_WEIGHT_EXCHANGE__<KEY>)."""

from __future__ import annotations

import dataclasses

from services.common.config import ServiceConfig, check_lease_seconds
from services.common.errors import FieldError
from services.weight_exchange.client.transports import KNOWN


@dataclasses.dataclass(kw_only=True)
class WeightExchangeConfig(ServiceConfig):
    grpc_address: str = "127.0.0.1:50055"
    default_transport: str = "tcp"
    bucket_bytes: int = 64 << 20        # transfers are coalesced into buckets of at most this size per link
    transfer_timeout: float = 120.0     # per receiver: every transfer of one update
    control_timeout: float = 60.0       # per receiver: pause + resume on top of the transfers
    verify: bool = False                # checksum pass after every update (a Sync may also ask for it)
    delta: bool = False                 # steady-state updates send only the elements that changed (each checked)
    full_every: int = 10                # with delta: a full update at least every this many updates per receiver
    agent_token: str = ""               # bearer token for the receivers' agents (default: auth_token)
    publish_events: bool = True         # VERSION_KIND_DEPLOYED on events.version after each successful Sync
    rank_ttl: float = 30.0              # a rank with no registration (heartbeat) for this long is dropped; <= 0: never
    sender_identities: list[str] = dataclasses.field(default_factory=lambda: ["trainer"])   # may register senders
    receiver_identities: list[str] = dataclasses.field(default_factory=lambda: ["rollout"])  # may register receivers
    check_agent_address: bool = True    # a receiver's agent_address must be the registering peer's (off behind a proxy)
    lease_seconds: float = 15.0         # one active instance: a second one waits as standby until the lease lapses


    def __post_init__(self) -> None:
        check_lease_seconds(self.lease_seconds)
        if self.default_transport not in KNOWN:
            raise FieldError("default_transport", f"unknown {self.default_transport!r} (known: {', '.join(KNOWN)})")
        if self.full_every < 1:
            raise FieldError("full_every", f"must be >= 1, got {self.full_every}")
        if self.bucket_bytes <= 0:
            raise FieldError("bucket_bytes", "must be positive")
        if self.transfer_timeout <= 0 or self.control_timeout <= 0:
            raise ValueError("transfer_timeout / control_timeout: must be positive")
