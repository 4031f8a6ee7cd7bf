"""Worker entry point: one process per GPU. See ``songserve.worker``."""

import sys

if __name__ == "__main__":  # the guard matters: dist_checkpointing starts spawn-based helpers
    from songserve.worker.main import main

    sys.exit(main())
