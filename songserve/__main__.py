"""``python -m songserve``: the command-line client (``songserve/cli/commands.py``)."""

import sys

from songserve.cli.commands import main

sys.exit(main())
