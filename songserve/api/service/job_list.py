"""``GET /jobs``: the caller's jobs, newest first, a page at a time.

Why: a page reloaded, or a second tab, must find again what its person made; the job ids were only
in the page's memory. The list is scoped exactly as ``GET /job/{id}`` is (``keys.py``'s ``sees``):
a key that sees its own jobs lists only those, one that sees all (or a dispatcher without keys)
lists every job. Paging is by the store's job sequence (``seq``, newer is larger), carried as an
opaque cursor, so a job submitted while someone pages never shifts a page by one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from songserve.api.jobs.facts import JobFacts
from songserve.api.jobs.records import Job
from songserve.api.jobs.views import job_view
from songserve.api.service.keys import Caller
from songserve.api.store.protocol import JobStore
from songserve.errors import NotFoundError
from songserve.schemas import JobAsked, JobList, JobListItem

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
CURSOR_PATTERN = r"^[0-9]{1,18}$"


async def list_jobs(
    store: JobStore,
    load: Callable[[str], Awaitable[Job]],
    facts: Callable[[Job], JobFacts],
    caller: Caller | None,
    limit: int,
    cursor: str | None,
) -> JobList:
    """Up to ``limit`` of the jobs ``caller`` may see, newest first, older than ``cursor`` when given."""
    owner = None if caller is None or caller.sees_all else caller.name
    rows = await store.jobs_newest_first(owner, int(cursor) if cursor else None, limit + 1)
    items = []
    for job_id, _ in rows[:limit]:
        try:
            job = await load(job_id)  # an active job from memory, a finished one from the store
        except NotFoundError:
            continue  # removed by retention since the ids were read
        f = facts(job)
        items.append(JobListItem(**job_view(job, f.positions, f.eta, f.waiting).model_dump(), asked=asked(job)))
    more = len(rows) > limit
    return JobList(jobs=items, next_cursor=str(rows[limit - 1][1]) if more else None)


def asked(job: Job) -> JobAsked:
    r = job.request
    fields = r.model_dump(include={"mode", "prompt_mode", "prompt", "tags", "duration"})
    return JobAsked(**fields, continue_from=r.continue_from)
