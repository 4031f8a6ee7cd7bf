"""Uploaded LoRA adapters: what ``POST /adapters`` and ``DELETE /adapters/{name}`` call, what each key sees
of ``GET /adapters``, and the workers' copies kept in step with the store.

A key allowed to (``upload_adapters``; ``API_KEY`` and a dispatcher without keys are) sends an
adapter's two files; only the workers know their models' shapes, so the dispatcher checks nothing
of the files but their size: it copies them to a staged folder of the results folder and sends them
to every online worker of ours (``PUT /adapters/{name}``), which reads them as it reads a folder
adapter at load. A worker's refusal is the client's 422 naming the file and the worker's reason, and
nothing is kept anywhere (a worker that took it is told to delete it). Accepted, the files become
``<results>/adapters/<name>/`` and a row of the job store (``store/adapters.py``), so any dispatcher
of a shared store answers for it.

Names are one namespace for the fleet: a name a worker's own ``ADAPTERS_DIR`` offers, or another
upload's, is a 409 naming ``name`` ("taken", never whose). An upload is its key's: another key
that does not see the owner's work (``keys.py``: ``sees``) does not find it in ``GET /adapters``, and
naming it in a take is the 422 of an unknown adapter (``hidden_from``); deleting it is a 404.

``sync`` (a dispatcher loop) keeps the workers in step: a worker without an upload the store has, or
with another copy (its ``/health`` lists each upload's SHA-256), is sent it; one listing an upload the
store no longer has is told to delete it. A worker that refused a copy is not sent it again.

Every removal names the copy it means (``DELETE /adapters/{name}?sha256=``: the copy this dispatcher
sent, or the one the worker's health listed), and a worker keeps another copy of the name: with
several dispatchers on one store, two uploads of one name at once leave the winner's copies where
they arrived last, and a sync round never removes an upload another dispatcher is sending now.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, NoReturn

from starlette.requests import Request

from songserve.api.dispatch.dispatcher import Dispatcher
from songserve.api.dispatch.pool import WorkerHandle
from songserve.api.jobs.facts import AdapterOffer
from songserve.api.results.artifacts import ADAPTER_FILES, ArtifactStore
from songserve.api.service.keys import Caller, may_see
from songserve.api.service.refusals import StoreUnavailable
from songserve.api.service.uploads import MULTIPART_SLACK, UploadGate
from songserve.api.settings import DispatcherSettings
from songserve.api.store.adapters import AdapterRecord
from songserve.api.store.protocol import JobStore, StoreError
from songserve.api.workers.outcomes import AdapterRefused, WorkerUnreachable
from songserve.errors import (
    ConflictError,
    FieldError,
    NotFoundError,
    RequestError,
    SongserveError,
    UnavailableError,
)
from songserve.http.forms import FormLimits, read_form
from songserve.schemas import AdapterView
from songserve.schemas.common import ADAPTER_PATTERN

log = logging.getLogger(__name__)
NAME = re.compile(ADAPTER_PATTERN)
SEND_TIMEOUT_SEC = 120.0  # one worker's reading and checking of an adapter (a few hundred MB at most)
FILES = ("config", "weights")  # the form's file fields, in ADAPTER_FILES' order
NEEDS = "is required: send the adapter as multipart/form-data with field name and files config and weights"


class NotAllowed(SongserveError):
    """A key whose ``upload_adapters`` is off (HTTP 403, ``limit`` in the body)."""

    http_status = 403

    def __init__(self, caller: Caller) -> None:
        super().__init__(f"The key '{caller.name}' may not upload adapters (its upload_adapters is off).")
        self.extra = {"limit": {"name": "upload_adapters", "value": False}}


class NameTaken(ConflictError):
    """A name the fleet already uses (HTTP 409 naming ``name``): never says whose."""

    def __init__(self, name: str) -> None:
        super().__init__(f"Field 'name': adapter name {name!r} is taken; choose another.")
        self.detail = [{"loc": ["body", "name"], "msg": f"adapter name {name!r} is taken", "type": "value_error"}]


class TooManyAdapters(ConflictError):
    """A key at ``MAX_UPLOADED_ADAPTERS`` (HTTP 409, ``limit`` in the body): delete one first."""

    def __init__(self, who: str, allowed: int, used: int) -> None:
        super().__init__(
            f"{who} has {used} uploaded adapters, the most MAX_UPLOADED_ADAPTERS ({allowed}) allows; delete one first."
        )
        self.extra = {"limit": {"name": "max_uploaded_adapters", "value": allowed, "used": used}}


class FleetAdapter(ConflictError):
    """``DELETE /adapters/{name}`` of an adapter of the workers' own folders (HTTP 409)."""


def adapter_limit(s: DispatcherSettings) -> tuple[int, str]:
    """``POST /adapters``' body limit (both files and the form's envelope) and its 413's sentence."""
    said = f"The adapter is larger than ADAPTER_MAX_MB ({s.adapter_max_mb:g} MB); nothing was stored."
    return int(s.adapter_max_mb * 2**20) + MULTIPART_SLACK, said


def may_upload(caller: Caller | None) -> bool:
    """No keys: anyone may; else the key's ``upload_adapters``."""
    return caller is None or caller.limits.upload_adapters


def hidden(offers: list[AdapterOffer], rows: dict[str, AdapterRecord], caller: Caller | None) -> set[str]:
    """The offered adapters ``caller`` must not find: uploads of keys it does not see, and uploads a
    worker still lists that the store no longer has (deleted; their workers are told to drop them)."""
    out = set()
    for o in offers:
        row = rows.get(o.name)
        if row is not None and not may_see(caller, row.caller):
            out.add(o.name)
        elif row is None and o.uploaded:
            out.add(o.name)
    return out


def listing(offers: list[AdapterOffer], rows: dict[str, AdapterRecord], caller: Caller | None) -> list[dict[str, Any]]:
    """``GET /adapters`` for ``caller``: the fleet's own adapters, and the uploads it may see with their owner."""
    gone = hidden(offers, rows, caller)
    out = []
    for o in offers:
        if o.name in gone:
            continue
        row = rows.get(o.name)
        view = asdict(o)
        if row is not None:
            view.update(uploaded=True, owner=row.caller, rank=o.rank or row.rank, bytes=row.bytes)
            view["targets"] = o.targets or row.targets
        out.append(view)
    return out


def plan_sync(
    held: dict[str, str], wanted: dict[str, str], refused: dict[str, str], creating: set[str]
) -> tuple[list[str], list[str]]:
    """What one worker is sent and told to delete, by name: the uploads of the store (``wanted``, name →
    sha256) it does not hold as they are (``held``: its ``/health``'s ``uploaded``), but for a copy it
    refused already (``refused``); and what it holds that the store no longer has, but for an upload
    being made now (``creating``: its row is not written yet)."""
    send = sorted(n for n, d in wanted.items() if held.get(n) != d and refused.get(n) != d)
    drop = sorted(n for n in held if n not in wanted and n not in creating)
    return send, drop


class AdapterService:
    def __init__(
        self, s: DispatcherSettings, store: JobStore, artifacts: ArtifactStore, dispatcher: Dispatcher, gate: UploadGate
    ) -> None:
        self.s = s
        self.store = store
        self.artifacts = artifacts
        self.dispatcher = dispatcher
        self.gate = gate  # shared with the audio uploads: one bound on bodies in flight
        self._creating: set[str] = set()  # names being uploaded here now (the sync leaves them alone)
        self._refused: dict[tuple[int, str], str] = {}  # (worker, name) → the sha256 it refused: not sent again

    # ---- what a key sees ------------------------------------------------------------------------
    async def rows(self) -> dict[str, AdapterRecord]:
        try:
            return {a.name: a for a in await self.store.adapters.all()}
        except StoreError as exc:
            raise StoreUnavailable(exc) from None

    async def hidden_from(self, caller: Caller | None) -> set[str]:
        """The adapter names a take of ``caller`` may not use: as unknown to it as a name no worker has."""
        offers = self.dispatcher.fleet().adapters
        if not any(o.uploaded for o in offers) and caller is None:
            return set()
        return hidden(offers, await self.rows(), caller)

    async def usable(self, caller: Caller | None) -> set[str]:
        """The adapter names a take of ``caller`` may name: what the workers offer, less ``hidden_from``."""
        return {o.name for o in self.dispatcher.fleet().adapters} - await self.hidden_from(caller)

    async def listing(self, caller: Caller | None) -> list[dict[str, Any]]:
        """``GET /adapters``' list for ``caller`` (``listing`` above)."""
        return listing(self.dispatcher.fleet().adapters, await self.rows(), caller)

    # ---- POST /adapters ---------------------------------------------------------------------------
    async def receive(self, request: Request, caller: Caller | None) -> AdapterView:
        """The key's permission and its count first (before a byte of the body), a place in line, then
        the form (its files spooled), then ``create``."""
        if caller is not None and not may_upload(caller):
            raise NotAllowed(caller)
        await self._check_count(caller)
        async with self.gate.ticket():
            content_type = request.headers.get("content-type", "")
            if not content_type.lower().startswith("multipart/form-data"):
                raise FieldError("config", NEEDS)
            body, too_large = adapter_limit(self.s)
            limits = FormLimits(body, 1024, int(self.s.adapter_max_mb * 2**20), too_large)
            form = await read_form(request.stream(), content_type, limits)
            try:
                name = form.fields.get("name", "").strip()
                if not name:
                    raise FieldError("name", NEEDS)
                if not NAME.match(name):
                    raise FieldError(
                        "name", f"{name[:80]!r} is not an adapter name (letters, digits, '.', '_', '-'; 64 at most)"
                    )
                for part in FILES:
                    if part not in form.files:
                        raise FieldError(part, NEEDS)
                return await self.create(name, form.files["config"].file, form.files["weights"].file, caller)
            finally:
                form.close()

    async def _check_count(self, caller: Caller | None) -> None:
        owner = caller.name if caller is not None else None
        try:
            used = await self.store.adapters.count_by(owner)
        except StoreError as exc:
            raise StoreUnavailable(exc) from None
        if used >= self.s.max_uploaded_adapters:
            who = f"The key '{owner}'" if owner is not None else "This dispatcher"
            raise TooManyAdapters(who, self.s.max_uploaded_adapters, used)

    def _takers(self) -> list[WorkerHandle]:
        """The workers that check and hold uploads: online, ours, serving adapters."""
        return [
            w
            for w in self.dispatcher.pool.workers
            if w.online and not w.client.reference and w.health.adapters is not None
        ]

    def _no_takers(self) -> NoReturn:
        """Why no worker can check an upload: none online (503: try again), or those online serve no adapters
        (the test tone, the reference's: 400, as for any request this fleet cannot serve)."""
        if not any(w.online for w in self.dispatcher.pool.workers):
            raise UnavailableError("No worker is online to check the adapter; nothing was stored, try again shortly.")
        raise RequestError(
            "No worker here serves adapters (those online run the test tone or are the reference's); "
            "nothing was stored."
        )

    async def _stored(self, name: str) -> bool:
        try:
            return await self.store.adapters.load(name) is not None
        except StoreError as exc:
            raise StoreUnavailable(exc) from None

    async def create(self, name: str, config: IO[bytes], weights: IO[bytes], caller: Caller | None) -> AdapterView:
        """Send the files to every worker that holds uploads; all that answered took them, or nothing is kept."""
        # Taken here and now, before any wait: a second upload of the name to this dispatcher meanwhile is a 409.
        if name in self._creating or any(o.name == name for o in self.dispatcher.fleet().adapters):
            raise NameTaken(name)
        self._creating.add(name)
        try:
            if await self._stored(name):
                raise NameTaken(name)
            await self._check_count(caller)
            takers = self._takers()
            if not takers:
                self._no_takers()
            async with self.gate.slot():
                staged, size, digest = await self.gate.run(self.artifacts.stage_adapter, config, weights)
            try:
                said = await self._send_all(name, staged, digest, takers)
                row = AdapterRecord(
                    name,
                    caller.name if caller is not None else None,
                    size,
                    digest,
                    int(said.get("rank") or 0),
                    [str(t) for t in said.get("targets") or []],
                    time.time(),
                )
                try:
                    stored = await self.store.adapters.insert(row)
                except StoreError as exc:
                    await self._drop_everywhere(name, takers, digest)
                    raise StoreUnavailable(exc) from None
                if not stored:  # another dispatcher of the store took the name meanwhile: its copies stay
                    await self._drop_everywhere(name, takers, digest)
                    raise NameTaken(name)
                await asyncio.to_thread(self.artifacts.keep_adapter, staged, name)
            finally:
                self.artifacts.discard(staged)
        finally:
            self._creating.discard(name)
        holders = [w.worker_id for w in takers if _holds(w, name, digest)]
        log.info(
            "adapter %s uploaded by %s: rank %d, %d bytes, sha256 %s, on workers %s",
            name,
            row.caller or "(no key)",
            row.rank,
            size,
            digest[:12],
            holders,
        )
        return view(row, holders)

    async def _send_all(self, name: str, staged: Path, digest: str, takers: list[WorkerHandle]) -> dict[str, Any]:
        """Every taker checks the files (``digest``: their weights' SHA-256); the first refusal (a 422 naming
        the file) undoes the others. A worker that does not answer is left to ``sync``; none answering is
        a 503."""
        config, weights = (staged / f for f in ADAPTER_FILES)
        answers = await asyncio.gather(
            *(w.client.put_adapter(name, config, weights, SEND_TIMEOUT_SEC) for w in takers), return_exceptions=True
        )
        refused = next((a for a in answers if isinstance(a, AdapterRefused)), None)
        took = [(w, a) for w, a in zip(takers, answers, strict=True) if isinstance(a, dict)]
        if refused is not None or not took:
            await self._drop_everywhere(name, [w for w, _ in took], digest)
        if refused is not None:
            if refused.status == 409:
                raise NameTaken(name)
            raise FieldError(refused.field, f"the worker refused it: {refused.reason}")
        if not took:
            why = next((str(a) for a in answers if isinstance(a, BaseException)), "no answer")
            raise UnavailableError(f"No worker could check the adapter now ({why}); nothing was stored.")
        for w, a in took:
            w.holds_upload(name, str(a["sha256"]))
        return took[0][1]

    async def _drop_everywhere(self, name: str, workers: list[WorkerHandle], digest: str) -> None:
        """Tell ``workers`` to remove their copy of ``name`` whose weights have ``digest`` (the copy this
        dispatcher sent or knows of): another copy of the name, a newer upload that another dispatcher of
        the store sent meanwhile, is kept."""

        async def drop(w: WorkerHandle) -> None:
            try:
                gone = await w.client.delete_adapter(name, digest)
            except WorkerUnreachable as exc:  # the sync tells it again
                log.warning("worker %d: adapter %s not removed (%s)", w.worker_id, name, exc)
                gone = True  # counted as gone until its health says otherwise
            if gone:
                w.dropped_upload(name)

        await asyncio.gather(*(drop(w) for w in workers))

    # ---- DELETE /adapters/{name} ----------------------------------------------------------------
    async def delete(self, name: str, caller: Caller | None) -> AdapterView:
        """Forget an upload of the caller's key: its row, its files, every worker's copy (a take running
        with it ends with it). Another key's is not found; one of the workers' own folders is a 409."""
        row = None
        if NAME.match(name):
            try:
                row = await self.store.adapters.load(name)
            except StoreError as exc:
                raise StoreUnavailable(exc) from None
        if row is None or not may_see(caller, row.caller):
            if row is None and any(o.name == name and not o.uploaded for o in self.dispatcher.fleet().adapters):
                raise FleetAdapter(
                    f"Adapter {name!r} is the fleet's own (a folder of the workers' ADAPTERS_DIR): "
                    "only uploads can be deleted here."
                )
            raise NotFoundError(f"No uploaded adapter {name[:64]!r} (GET /adapters lists yours).")
        try:
            await self.store.adapters.delete(name)
        except StoreError as exc:
            raise StoreUnavailable(exc) from None
        await asyncio.to_thread(self.artifacts.remove_adapter, name)
        holders = [w for w in self.dispatcher.pool.workers if w.online and _holds(w, name, None)]
        await self._drop_everywhere(name, holders, row.sha256)
        log.info("adapter %s deleted by %s", name, row.caller or "(no key)")
        return view(row, [])

    # ---- the workers' copies --------------------------------------------------------------------
    async def sync(self) -> None:
        """One round: send each worker the uploads it lacks (or holds another copy of), and tell it to
        delete those the store no longer has."""
        takers = self._takers()
        if not takers:
            return
        wanted = {a.name: a.sha256 for a in await self.store.adapters.all()}
        jobs = []
        for w in takers:
            held = w.health.adapters.uploaded if w.health.adapters is not None else {}
            refused = {n: d for (wid, n), d in self._refused.items() if wid == w.worker_id}
            send, drop = plan_sync(held, wanted, refused, self._creating)
            jobs += [self._send_one(w, name, wanted[name]) for name in send]
            jobs += [self._drop_stale(w, name, held[name]) for name in drop]
        await asyncio.gather(*jobs)

    async def _send_one(self, w: WorkerHandle, name: str, digest: str) -> None:
        folder = self.artifacts.adapter_folder(name)
        config, weights = (folder / f for f in ADAPTER_FILES)
        if not weights.is_file():
            return  # kept by another dispatcher's results folder, or deleted meanwhile
        try:
            said = await w.client.put_adapter(name, config, weights, SEND_TIMEOUT_SEC)
        except AdapterRefused as exc:
            self._refused[(w.worker_id, name)] = digest
            log.warning("worker %d refused adapter %s: %s", w.worker_id, name, exc.reason)
            return
        except WorkerUnreachable as exc:
            log.info("worker %d: adapter %s not sent (%s); next round", w.worker_id, name, exc)
            return
        w.holds_upload(name, str(said["sha256"]))
        log.info("worker %d: sent adapter %s", w.worker_id, name)

    async def _drop_stale(self, w: WorkerHandle, name: str, digest: str) -> None:
        """Remove the copy the worker's health listed (``digest``): a copy sent since, of an upload of
        that name another dispatcher is making now (its row not written yet), is kept."""
        try:
            gone = await w.client.delete_adapter(name, digest)
        except WorkerUnreachable as exc:
            log.info("worker %d: stale adapter %s not removed (%s); next round", w.worker_id, name, exc)
            return
        if not gone:
            log.info("worker %d: adapter %s holds another copy now; kept", w.worker_id, name)
            return
        w.dropped_upload(name)
        log.info("worker %d: removed adapter %s (its upload was deleted)", w.worker_id, name)


def _holds(w: WorkerHandle, name: str, digest: str | None) -> bool:
    held = w.health.adapters
    return held is not None and name in held.uploaded and (digest is None or held.uploaded[name] == digest)


def view(row: AdapterRecord, workers: list[int]) -> AdapterView:
    return AdapterView(
        name=row.name,
        owner=row.caller,
        rank=row.rank,
        targets=row.targets,
        bytes=row.bytes,
        sha256=row.sha256,
        created_at=row.created_at,
        workers=workers,
    )
