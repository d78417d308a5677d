from services.common.service import main
from services.rollout.config import RolloutConfig
from services.rollout.server import serve

if __name__ == "__main__":
    main("rollout", RolloutConfig, serve)
