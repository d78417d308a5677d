from services.common.service import main
from services.reward.config import RewardConfig
from services.reward.server import serve

if __name__ == "__main__":
    main("reward", RewardConfig, serve)
