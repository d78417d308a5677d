from services.common.service import main
from services.trainer.config import TrainerConfig
from services.trainer.server import serve

if __name__ == "__main__":
    main("trainer", TrainerConfig, serve)
