"""The weight exchange's public client: what runs inside trainer and inference ranks.

`SenderAgent` (trainer ranks) and `ReceiverAgent` (inference ranks), rank layouts, transports.
"""

from services.weight_exchange.client.agents import ReceiverAgent, SenderAgent
from services.weight_exchange.client.layout import RankLayout, Shard
from services.weight_exchange.client.regions import Region

__all__ = ["RankLayout", "ReceiverAgent", "Region", "SenderAgent", "Shard"]
