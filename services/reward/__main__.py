import os

# Code verifiers fork+exec the sandbox (subprocess with a uid: fork, not vfork) while gRPC threads run; gRPC's
# fork handlers then crash some children (SIGSEGV in cygrpc before exec: the run scores 0 as "killed, exit -11").
# The children only exec, so they need no gRPC fork support. Set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from services.common.service import main  # noqa: E402
from services.reward.config import RewardConfig  # noqa: E402
from services.reward.server import serve  # noqa: E402

if __name__ == "__main__":
    main("reward", RewardConfig, serve)
