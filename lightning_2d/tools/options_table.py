"""The README's "Strategy options" table, made from the options' fields (``lightning_2d.integration.options``)::

    python -m lightning_2d.tools.options_table                    # print it
    python -m lightning_2d.tools.options_table --write README.md  # replace it in the README

``tests/unit/test_options.py`` fails, naming the option, while the README's table differs from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from lightning_2d.integration.options import options_table

#: The README section whose first table is the options'.
README_HEADING = "### Strategy options"


def table_span(readme: str) -> tuple[int, int]:
    """Where the table under ``README_HEADING`` is: from its header row to the end of its last row."""
    heading = readme.index(README_HEADING)
    start = readme.index("\n|", heading) + 1
    end = readme.find("\n\n", start)
    return start, (len(readme) if end < 0 else end + 1)


def main(argv: Optional[list[str]] = None) -> None:
    """Print the README's options table, or replace it in the file given to ``--write``."""
    parser = argparse.ArgumentParser(prog="python -m lightning_2d.tools.options_table", description=main.__doc__)
    parser.add_argument("--write", type=Path, metavar="README", help="replace the table in this file")
    args = parser.parse_args(argv)
    if args.write is None:
        print(options_table(), end="")
        return
    text = args.write.read_text()
    start, end = table_span(text)
    args.write.write_text(text[:start] + options_table() + text[end:])


if __name__ == "__main__":
    main()
