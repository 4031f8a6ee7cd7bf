"""The parts a route depends on, one FastAPI dependency each (``compose.py`` made them in the lifespan).

A route names the part it uses (``jobs: JobService = JobsDep``) and nothing else: the job service for
jobs, the upload service for uploads, the adapter service for uploaded adapters, the announcements for workers, the readings for the probes and
reports. Async on purpose: FastAPI runs a sync dependency in a thread, a hop per request.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request

from songserve.api.compose import Parts
from songserve.api.service.adapters import AdapterService
from songserve.api.service.announcements import Announcements
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import CALLER, ApiKeys, Caller
from songserve.api.service.readings import Readings
from songserve.api.service.uploads import UploadService
from songserve.api.service.usage import UsageService


def parts(request: Request) -> Parts:
    """The running dispatcher's parts (set by the dispatcher app's lifespan): on ACE-Step's port, whose
    app fronts the dispatcher's (``state.host``), the same parts."""
    state = request.app.state
    found: Parts = state.host.state.parts if hasattr(state, "host") else state.parts
    return found


async def _jobs(request: Request) -> JobService:
    return parts(request).jobs


async def _uploads(request: Request) -> UploadService:
    return parts(request).uploads


async def _adapters(request: Request) -> AdapterService:
    return parts(request).adapters


async def _announcements(request: Request) -> Announcements:
    return parts(request).announcements


async def _usage(request: Request) -> UsageService:
    return parts(request).usage


async def _readings(request: Request) -> Readings:
    return parts(request).readings


async def _keys(request: Request) -> ApiKeys:
    return parts(request).keys


async def _tags(request: Request) -> dict[str, dict[str, Any]]:
    return parts(request).tags


def caller(request: Request) -> Caller | None:
    """The API key's caller (``keys.KeyAuth`` found it), or None without keys."""
    found: Caller | None = request.scope.get(CALLER)
    return found


JobsDep = Depends(_jobs)
UploadsDep = Depends(_uploads)
AdaptersDep = Depends(_adapters)
AnnouncementsDep = Depends(_announcements)
UsageDep = Depends(_usage)
ReadingsDep = Depends(_readings)
KeysDep = Depends(_keys)
TagsDep = Depends(_tags)
