"""The dispatcher's HTTP surface (shared/docs/api.md): thin routes over ``JobService``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, Header, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from songserve import __version__
from songserve.api import metrics
from songserve.api.artifacts import ArtifactStore
from songserve.api.service import JobService
from songserve.api.states import TERMINAL_JOB, JobStatus
from songserve.api.store import JobStore
from songserve.api.tags import TAGS
from songserve.errors import NotFoundError, RequestError
from songserve.http_errors import error_response, install_error_handlers
from songserve.http_guard import BearerAuth, BodyLimit
from songserve.schemas import GenerateAccepted, GenerateRequest, JobView
from songserve.settings import DispatcherSettings

STATIC = Path(__file__).resolve().parent.parent / "web"
TRACK_DONE = {"done", "error", "cancelled"}
MEDIA = {"mp3": ("audio/mpeg", "inline"), "wav": ("audio/wav", "attachment")}


def create_app(s: DispatcherSettings) -> FastAPI:
    holder: dict[str, JobService] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        headers = {"Authorization": f"Bearer {s.worker_token}"} if s.worker_token else {}
        client = httpx.AsyncClient(
            headers=headers, limits=httpx.Limits(max_connections=200, max_keepalive_connections=50)
        )
        store = JobStore(s.state_dir / "jobs.sqlite3")
        svc = JobService(s, store, ArtifactStore(s.state_dir / "results"), client)
        holder["svc"] = app.state.svc = svc
        await svc.start()
        yield
        await svc.drain(s.drain_timeout_sec)
        await svc.stop()
        await client.aclose()
        store.close()

    app = FastAPI(
        title="songserve",
        version=__version__,
        lifespan=lifespan,
        description="Song generation dispatcher: jobs of tracks over a pool of GPU workers.",
    )
    install_error_handlers(app)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=[o.strip() for o in s.cors_origins.split(",") if o.strip()],
        allow_origin_regex=r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?",
        allow_methods=["GET", "POST", "DELETE"],
        allow_headers=["Authorization", "Content-Type", "Idempotency-Key", "Range"],
    )
    if s.api_key:
        page = {"/", "/index.html", "/app.js", "/style.css", "/tags"} if s.public_page else set()
        app.add_middleware(BearerAuth, token=s.api_key, exempt={"/health", *page})
    app.add_middleware(BodyLimit, max_bytes=s.max_body_bytes)

    def svc() -> JobService:
        return holder["svc"]

    @app.post("/generate", response_model=GenerateAccepted)
    async def generate(
        req: GenerateRequest, idempotency_key: str | None = Header(None, max_length=200)
    ) -> GenerateAccepted:
        return svc().submit(req, idempotency_key)

    @app.get("/job/{job_id}", response_model=JobView)
    async def job(job_id: str) -> JobView:
        return svc().view(job_id)

    @app.delete("/job/{job_id}", response_model=JobView)
    async def cancel(job_id: str) -> JobView:
        return await svc().cancel(job_id)

    @app.api_route("/job/{job_id}/track/{idx}/{kind}", methods=["GET", "HEAD"])
    async def track_file(job_id: str, idx: int, kind: str) -> FileResponse:
        if kind not in MEDIA:
            raise NotFoundError(f"No such file kind {kind!r}; use mp3 or wav.")
        view = svc().view(job_id)
        if not 0 <= idx < len(view.tracks):
            raise RequestError(f"Track index {idx} is out of range for a job of {len(view.tracks)} tracks.")
        store = svc().artifacts
        if view.tracks[idx].status != "done" or not store.has(job_id, idx, kind):
            raise NotFoundError(f"Track {idx} of job {job_id} is not done.")
        media, disposition = MEDIA[kind]
        return FileResponse(
            store.path(job_id, idx, kind),
            media_type=media,
            filename=f"{job_id}_track{idx}.{kind}",
            content_disposition_type=disposition,
        )

    @app.get("/job/{job_id}/events")
    async def events(job_id: str, request: Request) -> StreamingResponse:
        svc().view(job_id)  # 404 before the stream starts

        async def stream() -> AsyncIterator[str]:
            last = None
            while not await request.is_disconnected():
                before = svc().version
                view = svc().view(job_id)
                body = view.model_dump_json()
                if body != last:
                    last = body
                    yield f"event: job\ndata: {body}\n\n"
                if JobStatus(view.status) in TERMINAL_JOB and all(t.status in TRACK_DONE for t in view.tracks):
                    return
                if await svc().wait_change(before, timeout=15) == before:
                    yield ": keep-alive\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/status")
    async def status() -> dict:
        return svc().status()

    @app.get("/tags")
    async def tags() -> dict:
        return TAGS

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "version": __version__, "accepting": svc().accepting}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        st = svc().status()
        ok = svc().accepting and any(w["status"] in ("idle", "busy") for w in st["workers"])
        if ok:
            return JSONResponse(
                {"status": "ready", "workers_ready": sum(w["status"] in ("idle", "busy") for w in st["workers"])}
            )
        return error_response(503, "No worker is ready." if svc().accepting else "The dispatcher is shutting down.")

    @app.get("/config")
    async def config() -> dict:
        return {
            "backbone_models": svc().models("backbone"),
            "superres_models": svc().models("superres"),
            "limits": {
                "duration_min": s.min_duration,
                "duration_max": s.max_duration,
                "max_tracks": s.max_tracks,
                "max_queue": s.max_queue,
                "max_lyrics_chars": s.max_lyrics_chars,
                "priority": [0, 9],
            },
            "defaults": {"num_tracks": 2, "duration": 3, "top_k_bb": 80, "temperature": 1.0, "top_k_sr": 10},
            "workers": len(svc().pool.workers),
            "version": __version__,
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prom() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(svc()), media_type="text/plain; version=0.0.4")

    if STATIC.is_dir():
        app.mount("/", StaticFiles(directory=STATIC, html=True), name="web")
    return app
