"""Jobs and tracks as plain records: their states, their phases and how they look on the wire.

Why a room of its own: every other part of the dispatcher names a job or a track, and none of them
should have to import the store, the dispatcher or a route to do it. This room imports no other
room of ``api/`` (``tests/unit/test_layout.py`` keeps that wall).

    records.py  ``Job``, ``Track``, ``TrackUpdate`` and the other records the store keeps
    states.py   track and job states: the enums, the legal transitions, the job status derivation
    phases.py   which track status a worker's phase means, and its weight in the overall percent
    views.py    a job and its tracks on the wire: progress, phase lines, status words
    facts.py    what the dispatcher tells the job service about a job and about the fleet
"""
