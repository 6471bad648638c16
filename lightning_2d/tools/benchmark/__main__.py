"""``python -m lightning_2d.tools.benchmark``: ``lightning-2d benchmark`` (and one rank of a job it started)."""

from lightning_2d.tools.benchmark.cli import main

if __name__ == "__main__":
    main()
