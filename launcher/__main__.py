"""`python -m launcher ...` is the `meshrl` command (launcher/cli.py), for a venv without the console script."""

from launcher.cli import main

if __name__ == "__main__":
    main(prog="python -m launcher")
