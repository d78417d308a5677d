"""The agent gateway: OpenAI- and Anthropic-compatible HTTP in front of the rollout engine.

Agents change only their base_url and api_key; every completion is recorded token-exactly into a session
and exported as trajectories with the reward the agent reports.
"""

from services.rollout.gateway.app import create_app
from services.rollout.gateway.budget import GroupBudget
from services.rollout.gateway.config import GatewayConfig
from services.rollout.gateway.server import serve_gateway

__all__ = ["GatewayConfig", "GroupBudget", "create_app", "serve_gateway"]
