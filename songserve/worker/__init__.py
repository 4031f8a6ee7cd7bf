"""The worker: one process per GPU serving one batch of takes at a time over HTTP.

Read as the dispatcher is: routes → runtime (the single model thread) → a ``Pipeline``.

    main.py, settings.py    settings (``WorkerSettings``), the checkpoint set, then serve
    launcher_flags.py       what each launcher flag does
    urls.py                 the URL rules the settings and the announcer share (``ANNOUNCE``, ``PUBLIC_URL``)
    app.py                  the application: its lifespan (load, sweep, announce), guards, the routers
    routes.py               the routes, by concern, over ``WorkerRuntime`` (dependencies, no closure)
    runtime.py              model lifecycle and the single model thread; drain; health; encodings
    states.py               ``WorkerStatus``'s legal moves (``check_transition``)
    tasks.py                ``TaskRegistry``: the running batch and the tasks run, cancel, views
    to_pipeline.py          the one translation between wire models and pipeline types
    failures.py, outputs.py why a task failed; the output folder, its disk, each file's size and SHA-256
    device.py, torch_device.py  where the model thread computes (the tone's CPU, or torch's device)
    host_memory.py          the heap's freed pages returned, oneDNN's kernel cache
    announce.py, metrics.py registering with dispatchers; Prometheus
    fence.py                a task sent under a lease epoch older than one seen is refused
    live_stream.py          ``GET /tasks/{id}/stream``: a running take's live audio, followed as it grows
"""
