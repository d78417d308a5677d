"""The weight exchange's public client: what runs inside trainer and inference ranks.

`SenderAgent` (trainer ranks) and `ReceiverAgent` (inference ranks), rank layouts, transports; `live_layout`
(a receiver's layout from its live parameters, see `layouts/live.py`) and `receiver_views`.
"""

from services.weight_exchange.client.agents import ReceiverAgent, SenderAgent
from services.weight_exchange.client.layout import RankLayout, Shard
from services.weight_exchange.client.layouts.live import LayoutMismatch, live_layout, receiver_views
from services.weight_exchange.client.regions import Region

__all__ = ["LayoutMismatch", "RankLayout", "ReceiverAgent", "Region", "SenderAgent", "Shard", "live_layout",
           "receiver_views"]
