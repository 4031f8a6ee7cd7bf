"""Build the tiny checkpoint set of the real architecture, deterministically.

    python -m songserve.pipeline.tiny [--out checkpoints/tiny] [--force]
    python -m songserve.pipeline.tiny --layout release OUT     # the published release's layout

Prints the set's folder on its last line (tests and scripts read it). What the sets hold: ``build.py``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from songserve.pipeline.config import DEFAULT_TINY_DIR
from songserve.pipeline.tiny.build import ensure_tiny_set


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m songserve.pipeline.tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, nargs="?", help="same as --out")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--layout", choices=("default", "release"), default="default")
    ap.add_argument("--force", action="store_true", help="rebuild even if a current set is there")
    args = ap.parse_args(argv)
    out = args.out_dir or args.out
    if out is None and args.layout == "release":
        ap.error("--layout release needs an output folder")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    print(ensure_tiny_set(out or DEFAULT_TINY_DIR, args.force, args.layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
