"""ACE-Step 1.5's HTTP dialect, served on its own port (``ACESTEP_PORT``) by the dispatcher process.

Why: ACE-Step's server (``acestep/api_server.py``) speaks a REST dialect (``/release_task``,
``/query_result``, ``/v1/audio``, every answer wrapped as ``{data, code, error, timestamp, extra}``)
that its Studio page, agent skills and wrappers already speak. Serving it here gives those clients
our model and our serving layer (durable queue, many workers, retries) with no change on their side.

The dialect is a second face of the same dispatcher: the same ``JobService``, store, queue,
workers, limits and metrics; an ACE-Step task *is* a job (``GET /job/{task_id}`` shows it).
Only the translation differs, and it lives here, one concern a module:

    bodies.py     a request body as ACE-Step reads it (JSON, +json, form, multipart, untyped)
    params.py     its alias table, nested sources (``param_obj``, ``metas``) and loose coercions
    translate.py  ACE-Step parameters → our ``GenerateRequest`` (what is ignored, what was read differently)
    repaint.py    ``task_type: repaint`` to the end checked in full, then handed to ``tasks.continue_from``
    tasks.py      submit and look up tasks through the ``JobService`` (a repaint: our ``continue_from``
                  retake of the source take); errors renamed to ACE-Step's fields
    answers.py    the wrapper, ``/query_result`` items and the ``result`` string, ``/v1/stats``
    files.py      opaque audio ids for ``/v1/audio?path=`` (never a filesystem path), FLAC on demand
    samples.py    ``/create_random_sample`` (from ``examples.json``, written for this project), ``/format_input``
    wrapper.py    ACE-Step's answer wrapper
    auth.py       the API key as ``ai_token`` or ``Authorization``
    stats.py      ``/v1/stats`` over the store
    failures.py   the dialect's errors (``detail`` for ACE-Step's clients, ``code``/``error`` for the wrapper's)
    routes.py     thin routes over the above
    app.py        the dialect's app, its CORS and auth, and the second listening socket

Facts about the dialect come from ACE-Step-1.5 at f30aee4c (read, not copied; see docs/api.md,
"ACE-Step's dialect", for where ours deliberately differs).
"""
