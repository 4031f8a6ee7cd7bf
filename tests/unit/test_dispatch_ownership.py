"""The pool owns ``WorkerHandle``: no other module of the dispatcher assigns a worker handle's fields (it
asks through the handle's methods), so what the dispatcher believes of a worker changes in one file."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from songserve.api.dispatch.attempts import Attempt
from songserve.api.dispatch.loops import LoopState
from songserve.api.dispatch.pool import WorkerHandle
from songserve.api.jobs.records import Job, Track

pytestmark = pytest.mark.quick
API = Path(__file__).resolve().parents[2] / "songserve" / "api"  # every room of the dispatcher


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# A field only a worker handle has (a record's field of the same name is that record's to write).
HANDLE_ONLY = names(WorkerHandle) - names(Attempt) - names(Track) - names(Job) - names(LoopState)


def writes(source: str) -> list[tuple[int, str]]:
    """(line, field) of each ``x.field = …`` / ``x.field += …`` on something other than ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Attribute) and not (isinstance(x.value, ast.Name) and x.value.id == "self"):
                    if x.attr in HANDLE_ONLY:
                        found.append((x.lineno, x.attr))
    return found


def test_only_the_pool_writes_a_worker_handles_fields():
    assert {"leased", "lease_epoch", "lease_valid_until", "handing_back", "encoding", "stalled"} <= HANDLE_ONLY
    files = sorted(API.rglob("*.py"))
    assert len(files) > 50
    offenders = {
        str(p.relative_to(API)): w
        for p in files
        if p.relative_to(API) != Path("dispatch/pool.py") and (w := writes(p.read_text()))
    }
    assert offenders == {}


def test_the_check_sees_a_write():
    assert writes("w.lease_valid_until = 0.0\nw.faults += 1\nself.leased = True\n") == [
        (1, "lease_valid_until"),
        (2, "faults"),
    ]
