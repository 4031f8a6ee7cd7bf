"""The job service: what the routes (ours and ACE-Step's) call, and what it checks on the way in.

A submit is read (``requests.py``), checked against the caller's key and quota (``keys.py``,
``usage.py``), resolved when it continues a take (``dispatch/retakes.py``) and handed to the
dispatcher; reads come back as views (``jobs/views.py``).

    job_service.py    ``JobService``: submit, read, list, cancel, files, renders, live streams, waits
    readings.py       ``Readings``: what the probes and reports read (``/health``, ``/ready``, ``/metrics``…)
    requests.py       a ``POST /generate`` body as the reference reads it, and what was changed
    keys.py           API keys: who is calling, by name, with what limits
    usage.py          a key's limits at submit, and ``GET /usage`` (``UsageService``)
    refusals.py       what a submit, a file or an announcement cannot get, one status each
    uploads.py        a person's own audio: checked, stored, queued for encoding
    live.py           ``GET /job/{id}/track/{i}/stream``: the relays behind it
    live_feed.py      one live track's relay, shared by its listeners
    live_spool.py     one live track's bytes, written once, read by every listener
    announcements.py  workers that join and leave (``POST /workers``)
    job_list.py       ``GET /jobs``: the caller's jobs, a page at a time
"""
