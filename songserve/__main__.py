"""``python -m songserve``: the command-line client (``songserve/client.py``)."""

import sys

from songserve.client import main

sys.exit(main())
