"""The dispatcher: which worker runs which track, and everything a track lives through there.

A queued track is placed on a free worker (``placement.plan``, in ``queue_order.py``'s order: a plan the
dispatch pass then applies), run as an attempt (one record and one story, read top to bottom in
``attempts.py``: its start, its answer, its stop, its fence), and either completed with its files
(``results/``) or tried again elsewhere. The worker pool's health and the store's membership say which workers this dispatcher may
use.

    dispatcher.py     ``Dispatcher``: the parts put together, and its loops
    tracks.py         the track book: the active jobs, the queue, every change of a track's state
    attempts.py       one attempt of a track (or a batch of one job's takes) on one worker, one record
                      (``Attempt``) per track: its start (claim under the lease, the request), its
                      answer (progress, the outcome), its stop (watchdog, health, cancel, a retry or
                      the last try) and its fence (the lease its writes carry, a lost one)
    retries.py        how an attempt ended → the track's next state; which failures cost a try (pure)
    pool.py           the workers, what the dispatcher believes of each (changed only through the
                      handle's methods), the health poll
    membership.py     which dispatchers are alive and which workers this one may use
    placement.py      the dispatch plan (pure): which free worker each queued track goes to, which
                      takes go with it, and why the others wait
    queue_order.py    priority first, fair across jobs, FIFO within a priority
    retakes.py        ``continue_from``: a retake or a continuation, checked and resolved
    encodings.py      a queued upload to a free worker, its codes into the results folder
    estimates.py      speed history, and the ETA it gives
    readiness.py      ``/status``, ``/ready`` and ``/config``: the parts' states read in one place
    loops.py          supervised background loops; ``SharedPasses``: one dispatch pass shared by its callers
"""
