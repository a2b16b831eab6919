"""``python -m shardline``: the ``shardline`` command line, e.g. ``python -m shardline run``."""

from __future__ import annotations

import sys

from shardline.cli import main

if __name__ == "__main__":
    sys.exit(main())
