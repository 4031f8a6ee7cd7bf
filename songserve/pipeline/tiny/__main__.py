"""Build the tiny checkpoint set of the real architecture, deterministically.

    python -m songserve.pipeline.tiny [--out checkpoints/tiny] [--force]
    python -m songserve.pipeline.tiny --layout release OUT     # the published release's layout

Prints the set's folder on its last line (tests and scripts read it). What the sets hold: ``build.py``.
A worker runs this with ``--die-with-parent`` (``child.py``). ``LOG_LEVEL=debug`` shows the
libraries' start-up warnings.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from songserve.pipeline.config import DEFAULT_TINY_DIR
from songserve.pipeline.tiny.child import die_with_parent
from songserve.pipeline.tiny.manifest import is_current
from songserve.process.logs import level_from_env, setup_logging


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m songserve.pipeline.tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, nargs="?", help="same as --out")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--layout", choices=("default", "release"), default="default")
    ap.add_argument("--force", action="store_true", help="rebuild even if a current set is there")
    ap.add_argument("--die-with-parent", type=int, metavar="PID", help="stop (with helpers) when PID dies")
    args = ap.parse_args(argv)
    if args.die_with_parent:
        die_with_parent(args.die_with_parent)
    out = args.out_dir or args.out
    if out is None and args.layout == "release":
        ap.error("--layout release needs an output folder")
    out = out or DEFAULT_TINY_DIR
    if not args.force and is_current(out, args.layout):
        print(out)  # a current set: said without torch's import (seconds), as the build would say it
        return 0
    import torch

    from songserve.pipeline.tiny.build import ensure_tiny_set

    setup_logging("tiny", level_from_env())
    torch.set_num_threads(1)
    print(ensure_tiny_set(out, args.force, args.layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
