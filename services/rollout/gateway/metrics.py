"""Prometheus counters for the gateway (served by the hosting service's metrics endpoint)."""

from __future__ import annotations

import prometheus_client

REQUESTS = prometheus_client.Counter("meshrl_gateway_requests_total", "Model requests answered", ["api", "outcome"])
REUSED_TOKENS = prometheus_client.Counter("meshrl_gateway_reused_prompt_tokens_total",
                                          "Prompt tokens taken verbatim from earlier sampled context")
PROMPT_TOKENS = prometheus_client.Counter("meshrl_gateway_prompt_tokens_total", "Prompt tokens sent to the engine")
SESSIONS = prometheus_client.Counter("meshrl_gateway_sessions_total", "Sessions by how they ended", ["event"])
TRAJECTORIES = prometheus_client.Counter("meshrl_gateway_trajectories_total", "Trajectories exported")
CAPACITY = prometheus_client.Gauge("meshrl_gateway_capacity_groups",
                                   "Agent groups the staleness budget still admits (-1: unlimited, no budget announced)")
DROPPED = prometheus_client.Counter("meshrl_gateway_trajectories_dropped_total",
                                    "Exported trajectories the bus refused for good (never retried), by error",
                                    ["error"])
