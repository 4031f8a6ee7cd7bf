"""Dispatcher entry point. See ``songserve.api``."""

import sys

if __name__ == "__main__":
    from songserve.api.main import main

    sys.exit(main())
