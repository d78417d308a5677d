"""What every service shares. Imported before any service imports grpc, so the setting below holds everywhere."""

import os

# Services fork children that only exec (the reward's sandbox runs, the rollout's vLLM server) while gRPC threads
# run; gRPC's fork handlers then crash some children before the exec (SIGSEGV in cygrpc: a sandboxed run scored 0
# as "killed, exit -11"). Nothing forked here uses gRPC, so its fork support is off. Set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
