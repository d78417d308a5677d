"""The weight exchange's public client: what runs inside trainer and inference ranks.

`SenderAgent` (trainer ranks) and `ReceiverAgent` (inference ranks), rank layouts, transports; `live_layout`
(a receiver's layout from its live parameters, see `layouts/live.py`) and `receiver_views`.

The names are imported on first use: an inference engine's worker (vLLM's, in its own venv without gRPC's
health package) imports only the data plane (`sink`, `transports`) and pulls its own bytes.
"""

import importlib
from typing import Any

_EXPORTS = {
    "ReceiverAgent": "agents", "SenderAgent": "agents", "RankLayout": "layout", "Shard": "layout",
    "LayoutMismatch": "layouts.live", "live_layout": "layouts.live", "receiver_views": "layouts.live",
    "Region": "regions",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
