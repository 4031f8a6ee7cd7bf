"""Our real model worker whose backbone a test can hold at fixed points: live audio proofs without a race.

    SONGSERVE_HOLD_DIR=DIR python tests/support/held_worker.py [any worker flag]

Whether audio reaches a listener *while* the backbone writes depends, on a loaded machine, on how
the preview thread and the backbone share the cores: the tiny backbone can finish a 30 s take before
the preview's first window is decoded. This wrapper makes it a fact the test controls: when a take's
backbone passes a third of its token budget, and again at two thirds, it waits while the file
``DIR/hold-1`` (then ``DIR/hold-2``) exists. The preview thread runs on meanwhile, so the test hears
audio, sees the track still generating, and deletes the file to let the backbone go on. Without the
files nothing waits. The output does not change: the backbone's draws follow from the seed alone.

On SIGUSR1 it drops its KV snapshots and zeroes their counters (restored tokens, faults), as after
start: one worker is shared by the test files of a test process (tests/support/tiny_site.py), and a retake
test's proof is a fresh cache. The test waits for ``/health`` to show it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

HOLD_LIMIT_SEC = 300.0  # a test that never lets go fails on its own timeout, not on a hung worker


def hold_backbone_at_thirds(hold_dir: Path) -> None:
    import torch

    from songserve.pipeline.live_audio.previewer import Previewer

    heard = Previewer.tokens

    def tokens(self: Previewer, take: int, first: int, codes: torch.Tensor) -> None:
        heard(self, take, first, codes)
        budget = self.rows[take].flat.shape[0]
        for k, at in ((1, budget // 3), (2, 2 * budget // 3)):
            if first < at <= first + int(codes.shape[0]):
                hold, deadline = hold_dir / f"hold-{k}", time.monotonic() + HOLD_LIMIT_SEC
                while hold.exists() and time.monotonic() < deadline:
                    # The preview thread starts on a batch of tokens once a listener wants the take: one
                    # who came after the last batch before the hold gets it from this empty batch.
                    heard(self, take, first + int(codes.shape[0]), codes[:0])
                    time.sleep(0.02)

    Previewer.tokens = tokens  # type: ignore[method-assign]


def clear_kv_snapshots_on_sigusr1() -> None:
    from songserve.pipeline.engine.kv_snapshots import KVSnapshots

    made: list[KVSnapshots] = []
    init = KVSnapshots.__init__

    def __init__(self: KVSnapshots, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    def clear() -> None:
        for snaps in made:
            snaps.clear()  # under the cache's lock
            snaps.restored_total = snaps.faults = 0

    KVSnapshots.__init__ = __init__  # type: ignore[method-assign]
    # off the signal handler: the main thread may hold the cache's lock (in /health) when it comes
    signal.signal(signal.SIGUSR1, lambda signum, frame: threading.Thread(target=clear, daemon=True).start())


if __name__ == "__main__":  # the guard matters: dist_checkpointing starts spawn-based helpers
    from songserve.worker.main import main

    hold_backbone_at_thirds(Path(os.environ["SONGSERVE_HOLD_DIR"]))
    clear_kv_snapshots_on_sigusr1()
    sys.exit(main())
