"""The only code that speaks to workers: typed calls out, typed answers in.

Nothing else in the dispatcher builds a worker's URL or reads a worker's body; the worker's
contract lives in ``songserve/schemas/`` and is translated in one place (``to_worker.py``).

    client.py     ``WorkerClient``: generate, batches, encodings, task lookups, live audio, files
    to_worker.py  a job's track into what a worker receives (ours or the reference's)
    outcomes.py   what a worker's answer means, and the ways a call ends without one
"""
