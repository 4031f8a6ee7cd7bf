"""The tasks a worker knows: the running batch, and the tasks it ran, remembered (bounded).

A dispatcher that lost its connection collects a finished task with ``GET /tasks/{task_id}``, so
each task's ``TaskView`` is kept after it ends; the oldest are forgotten past
``MAX_REMEMBERED_TASKS`` (their files can still be found by their JSON). The running batch is the
one record of what runs: its first take is the task ``/health`` names, and the worker is busy
exactly while it is not empty. The runtime changes it, under its lock, on the event loop only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from songserve.errors import NotFoundError, RequestError
from songserve.pipeline.context import TaskContext
from songserve.schemas import TakeHealth, TaskState, TaskView

log = logging.getLogger(__name__)
MAX_REMEMBERED_TASKS = 256


class TaskRegistry:
    def __init__(self, limit: int = MAX_REMEMBERED_TASKS) -> None:
        self.limit = limit
        self.batch: list[TaskContext] = []  # every take of the running batch; empty when none runs
        self._views: OrderedDict[str, TaskView] = OrderedDict()

    @property
    def current(self) -> TaskContext | None:
        """The first take of the running batch, else None."""
        return self.batch[0] if self.batch else None

    def begin(self, ids: list[str]) -> list[TaskContext]:
        """Make ``ids`` the running batch, each remembered as running; a task id run before is refused."""
        for task_id in ids:
            if task_id in self._views:
                raise RequestError(f"Task {task_id} was already run on this worker.")
        self.batch = [TaskContext(task_id) for task_id in ids]
        for task_id in ids:
            self.remember(TaskView(task_id=task_id, status=TaskState.running))
        return list(self.batch)

    def end(self) -> None:
        self.batch = []

    def remember(self, view: TaskView) -> None:
        self._views[view.task_id] = view
        self._views.move_to_end(view.task_id)
        while len(self._views) > self.limit:
            self._views.popitem(last=False)

    def get(self, task_id: str) -> TaskView | None:
        """The remembered view as recorded (no live progress), else None."""
        return self._views.get(task_id)

    def running(self, task_id: str) -> TaskContext | None:
        """The running take with ``task_id`` (one of the batch), else None."""
        return next((c for c in self.batch if c.task_id == task_id), None)

    def cancel(self, task_id: str, phase: str) -> TaskView:
        """Ask a running take to stop (it stops at its next check); a finished task's view is returned as is."""
        ctx = self.running(task_id)
        if ctx is not None:
            ctx.cancel()
            log.info("task %s: cancel requested", task_id)
            return TaskView(task_id=task_id, status=TaskState.running, phase=phase)
        if task_id in self._views:
            return self._views[task_id]
        raise NotFoundError(f"Task {task_id} is not known to this worker.")

    def view(self, task_id: str) -> TaskView:
        """``GET /tasks/{task_id}``: the remembered view, with live progress while the task runs."""
        view = self._views.get(task_id)
        if view is None:
            raise NotFoundError(f"Task {task_id} is not known to this worker.")
        ctx = self.running(task_id)
        if view.status is TaskState.running and ctx is not None:
            p = ctx.snapshot()
            view = view.model_copy(update={"progress": p.percent, "phase": p.phase})
        return view

    def take_health(self) -> list[TakeHealth]:
        """``/health``'s ``tasks``: each take of the running batch with its own progress."""
        out = []
        for ctx in list(self.batch):
            p = ctx.snapshot()
            wanted = ctx.live.wanted()  # only then the live fields are set (/health leaves unset ones out)
            live = {"live": ctx.live.state.value, "preview_sec": round(ctx.live.seconds, 2)} if wanted else {}
            out.append(
                TakeHealth(
                    task_id=ctx.task_id,
                    phase=p.phase,
                    progress=p.percent,
                    progress_detail=p.detail,
                    tokens_per_sec=p.rate,
                    cancelled=ctx.cancelled(),
                    last_progress_at=p.updated_at,
                    **live,
                )
            )
        return out
