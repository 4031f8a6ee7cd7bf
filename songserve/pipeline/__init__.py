"""The model pipeline: prompt → backbone (q0/q1) → super-resolution (q2..q63) → decoder → files.

Seven rooms: ``stages/`` (one module per stage, each with a typed seam), ``engine/`` (the
transformer the stages run), ``checkpoints/`` (which files make a set, and loading them),
``adapters/`` (LoRA adapters' files and which a worker holds), ``tiny/`` (writers of the tiny
checkpoint sets), ``live_audio/`` (a take's audio while it is made) and ``testing/`` (the test
tone, run instead of the model). Each room's ``__init__.py`` lists its modules. At the top, the orchestration and the seams:

    types.py         the seams: ``TrackRequest``/``TrackResult``, the ``Pipeline`` Protocol the worker drives
    context.py       cancellation and progress of one task
    config.py        what the pipeline reads of its process's settings, as Protocols
    pipeline.py      ``ModelPipeline``: the stages in order for one request's takes
    finish.py        the decoder, metadata and files of one take
    encoding.py      one upload's encoding on the model thread
    continuation.py  a retake's kept frames as the stages take them, a repaint's splice and metadata
    residency.py     where each stage's weights are (``RUNTIME_MODE``)
    numbers.py       the model's numbers, once
"""
