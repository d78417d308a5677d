from services.builder.config import BuilderConfig
from services.builder.server import serve
from services.common.service import main

if __name__ == "__main__":
    main("builder", BuilderConfig, serve)
