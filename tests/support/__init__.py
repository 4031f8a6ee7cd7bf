"""What the tests share: servers, fakes, probes and the suite's plugins. Which to use for what:

The tiers (each folder's ``conftest.py`` marks its tests; ``tiers.py``):

- ``tests/unit/``: pure logic in the test process, no sockets (fakes: ``fake_fleet.py``,
  ``httpx.MockTransport``);
- ``tests/integration/``: servers in threads of the test process on real sockets, a throw-away
  PostgreSQL, a command-line client against them;
- ``tests/process/``: real processes for what only a process shows (signals, ``kill -9``, full
  disks, memory, load, the launcher); also the container proofs ``scripts/test-containers`` runs;
- ``tests/model/``: the tiny checkpoint set through the pipeline and a real model worker, the
  release's own files (``tests/fixtures/``);
- ``tests/browser/``: pages in headless Chromium.

Starting a server, one way for each kind:

- **A dispatcher over tone workers, no process boundary needed**: ``servers.Cluster(tmp,
  threads=True)`` (both served by ``in_thread.py``: the programs' own apps and settings loader under
  uvicorn in threads, no process start). Lower level: ``in_thread.tone_worker`` / ``in_thread.dispatcher``.
- **A real worker process**: ``servers.start_worker`` (tone worker with ``--pipeline test``, or the
  tiny model); a stand-in: ``servers.start_reference_worker`` (``reference_worker.py``),
  ``servers.start_bad_worker`` (``bad_worker.py``), ``script="tests/support/late_worker.py"``.
- **A real dispatcher process**: ``servers.Cluster(tmp)`` or ``servers.cluster_of(tmp, workers,
  *flags)`` over workers already started. Files that need a dispatcher of their own shape still build
  ``servers.ServerProcess(["backend_api.py", ...])`` by hand. **Dispatchers sharing a PostgreSQL
  store** over tone worker processes: ``pg_fleet.py`` (``start_dispatcher``, ``tone_workers``).
- **Every real process** goes through ``servers.ServerProcess``: forked from a template that has
  imported what the program imports (``zygote.py``; never call it directly, but ``zygote.run`` for a
  one-off command such as a benchmark's smoke run); ``fresh=True`` for what a cold start shows.
- **The tiny-model worker**: the fixtures ``shared_tiny`` / ``shared_release`` (one per test
  process, ``tiny_site.py``, its hold points ``held_worker.py``), lent to a file with ``lent``; a
  dispatcher over it: the ``tiny_site`` fixture. A worker with flags of its own: ``start_worker``.
- **The launcher** (``run_backend.sh``): ``launcher.py`` (``launcher_env``, ``run_launcher``, a port
  ``held`` while it starts, the start-up ``NOISE`` its logs must not carry) and
  ``servers.wait_launched``; what it left behind: ``procs.py``.
- **Other servers**: a webhook receiver (``receiver.py``), PostgreSQL (``pg.py``, the ``pg_url``
  fixture).

Probes: ``listeners.py`` (sockets a process listens on), ``load_probe.py`` (peak memory, health
under load, raw requests, a ``Crowd`` of stream listeners). Data: ``audio.py`` (music-like audio and its file bytes),
``plain_encoder.py`` (an independent codec encoder to compare with), ``stores.py`` (a job store of
either engine, two dispatchers' views of one, the records the store tests write; the ``engine``
fixture is the integration tier's ``conftest.py``), ``fake_fleet.py``'s ``aio``/``body``/``run_job``
for the in-process dispatcher. Plugins: ``tiny_site.py``, ``schedule.py`` (units, order, durations).
Every httpx client passes ``verify=http.TLS`` (``http.py``). A test file imports no other test file
(``tests/unit/test_suite_shape.py``): what two share lives here.
"""
