"""``python -m lightning_2d.tools.planner``: ``lightning-2d plan``."""

from lightning_2d.tools.planner.cli import main

if __name__ == "__main__":
    main()
