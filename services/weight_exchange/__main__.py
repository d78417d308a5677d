"""`python -m services.weight_exchange`: the weight-exchange service."""

from services.common.service import main
from services.weight_exchange.config import WeightExchangeConfig
from services.weight_exchange.server import serve

if __name__ == "__main__":
    main("weight_exchange", WeightExchangeConfig, serve)
