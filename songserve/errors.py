"""One exception tree for the whole package.

    SongserveError                 a human sentence, safe to show a client
    ├── ConfigError                bad settings or a missing/mismatched checkpoint: refuse to start
    ├── RequestError               a request that cannot be served as asked (HTTP 4xx)
    │   ├── FieldError             a request field that cannot be served (HTTP 422, ``detail`` names it)
    │   └── NotFoundError          an unknown job, track, task or file (HTTP 404)
    ├── UnavailableError           draining or not ready (HTTP 503)
    ├── BusyError                  the worker already runs a task (HTTP 409)
    ├── TaskCancelled              a task stopped at a cancellation point (not asyncio.CancelledError)
    └── TaskError                  a task failed inside the model or the export (reported, not retried)
        └── WorkerStateError       it failed because of the worker's own state, not the input (retried elsewhere)

Every message is one sentence for a person; tracebacks go to the log, never to a client.
"""


class SongserveError(Exception):
    """Base class: ``str(exc)`` is a sentence that may be shown to a client.

    ``headers`` (e.g. Retry-After) travel with the answer; ``detail`` (validation entries) and ``extra``
    (more fields, e.g. the ``limit`` a key is over) into the error body.
    """

    http_status = 500
    headers: dict[str, str] | None = None
    detail: list[dict[str, object]] | None = None
    extra: dict[str, object] | None = None


class ConfigError(SongserveError):
    """Settings or checkpoint files that cannot work; the process refuses to start."""


class RequestError(SongserveError):
    http_status = 400


class FieldError(RequestError):
    """A request field that cannot be served as sent: 422 with ``detail`` naming the field."""

    http_status = 422

    def __init__(self, field: str, message: str, where: str = "body", index: int | None = None) -> None:
        super().__init__(f"Field '{field}': {message}.")
        # a nested field ("continue_from.at_sec") as pydantic writes its location: one entry per level; with
        # ``index``, the level that is that number is a list's item, a number as in pydantic's own
        # ("continue_from.parts.1", 1 → ..., "parts", 1)
        loc: list[str | int] = [where, *field.split(".")]
        if index is not None:
            loc = [index if x == str(index) else x for x in loc]
        self.detail = [{"loc": loc, "msg": message, "type": "value_error"}]


class NotFoundError(RequestError):
    http_status = 404


class ConflictError(RequestError):
    """The request conflicts with what exists (a name taken): HTTP 409."""

    http_status = 409


class UnavailableError(SongserveError):
    """Shutting down, or not ready: try again later or elsewhere (HTTP 503)."""

    http_status = 503


class BusyError(SongserveError):
    http_status = 409


class TaskCancelled(SongserveError):
    http_status = 409


class TaskError(SongserveError):
    http_status = 500


class WorkerStateError(TaskError):
    """A task failed because of state its worker keeps (a cache it had to drop), not its input: another
    worker may succeed (``ErrorKind.environment``)."""
