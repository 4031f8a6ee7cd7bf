"""The model's numbers, defined once: every module that needs one imports it from here.

Facts of the trained model and of the reference, not settings. A checkpoint set's files still say
what they hold (the decoder's YAML its rates and sample rate, a checkpoint its vocabulary): these
numbers are what the code assumes where a file says nothing, what the vocabulary is split by, and
what the test tone pipeline and the progress estimate use.
"""

from __future__ import annotations

CODEBOOK = 1024  # entries per codebook: level c's audio ids are [T + c·1024, T + (c+1)·1024)
BACKBONE_LEVELS = 2  # the backbone writes q0 and q1
SUPERRES_LEVELS = 64  # super-resolution fills q2..q63: 64 levels in all, the decoder's codebooks
LEVELS = {"backbone": BACKBONE_LEVELS, "superres": SUPERRES_LEVELS}  # by model kind

SAMPLE_RATE = 44100  # Hz
HOP = 2048  # samples per frame (the decoder's upsampling rates 8·8·8·4)
FRAMES_PER_SECOND = SAMPLE_RATE / HOP  # 21.53
TOKENS_PER_MINUTE = 2584  # the reference's progress estimate: 21.53 frames/s × 2 tokens × 60 s
