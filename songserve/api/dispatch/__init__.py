"""The dispatcher: which worker runs which track, and everything a track lives through there.

A queued track is placed on a free worker (``placement.py``, in ``queue_order.py``'s order), run as an
attempt (one story, read top to bottom: its start and its answer in ``attempts.py``, its stop and its
fence in ``attempt_ends.py``), and either completed with its files (``results/``) or tried again
elsewhere. The worker pool's health and the store's membership say which workers this dispatcher may
use.

    dispatcher.py     ``Dispatcher``: the parts put together, and its loops
    tracks.py         the track book: the active jobs, the queue, every change of a track's state
    attempts.py       one attempt of a track (or a batch of one job's takes) on one worker: its start
                      (claim under the lease, the request) and its answer (progress, the outcome)
    attempt_ends.py   how an attempt ends otherwise: its stop (watchdog, health, cancel, a retry or
                      the last try) and its fence (the lease its writes carry, a lost one)
    retries.py        which failures cost a track a try, and when it has none left (pure)
    pool.py           the workers, what the dispatcher believes of each, the health poll
    membership.py     which dispatchers are alive and which workers this one may use
    placement.py      which free worker a track goes to, and which takes go with it
    queue_order.py    priority first, fair across jobs, FIFO within a priority
    retakes.py        ``continue_from``: a retake or a continuation, checked and resolved
    encodings.py      a queued upload to a free worker, its codes into the results folder
    estimates.py      speed history, and the ETA it gives
    readiness.py      ``/status``, ``/ready`` and ``/config``: the parts' states read in one place
    loops.py          supervised background loops
"""
