"""``/mcp``: the dispatcher's MCP server, over the protocol's Streamable HTTP transport, stateless.

Stateless: every request stands alone (no ``Mcp-Session-Id``, nothing kept between requests), so any
dispatcher of a fleet answers any request, as it does ``GET /job/{id}``. The SDK's lowlevel ``Server``
is used rather than its decorator layer so that each tool's input schema is the argument model of
``tools.py`` (the HTTP API's own fields), not one inferred from a function's signature.

The key is the HTTP API's: ``KeyAuth`` has named the caller (``Authorization: Bearer <key>``) before a
byte of the body is read, and ``BodyLimit`` bounds the body (``MCP_MAX_MB`` as base64, for
``upload_audio``). A body larger than ``MAX_BODY_BYTES`` is read only while one of
``UPLOAD_CONCURRENCY`` places is free (else a 503 with ``Retry-After`` before reading it), so a flood of
large messages never holds more than that many in memory. Every failure of a tool is the tool's error
(``isError``) with the HTTP API's sentence; one it did not expect is logged and said in one sentence,
never a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from songserve import __version__
from songserve.api.mcp.calls import CALLS, Call
from songserve.api.mcp.resources import TEMPLATES, Reader
from songserve.api.mcp.tools import ToolSpec, max_audio_bytes, tool_specs
from songserve.api.service.adapters import AdapterService
from songserve.api.service.job_service import JobService
from songserve.api.service.keys import CALLER, Caller
from songserve.api.service.uploads import UploadService
from songserve.api.settings import DispatcherSettings
from songserve.errors import NotFoundError, SongserveError
from songserve.http.errors import validation_message
from songserve.http.guard import send_error

log = logging.getLogger(__name__)
INTERNAL = "Internal error; see the server log."
RESOURCE_NOT_FOUND = -32002  # the MCP specification's code for a resource that is not there
INVALID_PARAMS = -32602
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
RETRY_AFTER_SEC = 5
INSTRUCTIONS = (
    "songserve makes songs from a style and lyrics. make_song starts one (list_style_tags names the styles); "
    "wait_for_job follows it with progress and answers each finished take as a resource (song://job/track, the "
    "MP3) and an HTTP link; retake regenerates a take from a second on, repaint a part of it, extend_start writes a new opening; "
    "list_adapters names the fine-tuned sounds make_song's adapter takes; cancel_job stops one."
)


def tool(spec: ToolSpec) -> types.Tool:
    schema = spec.arguments.model_json_schema()
    schema.pop("title", None)
    hints = types.ToolAnnotations(title=spec.title, read_only_hint=spec.read_only, destructive_hint=spec.destructive)
    return types.Tool(
        name=spec.name, title=spec.title, description=spec.description, input_schema=schema, annotations=hints
    )


def refused(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)


def answered(body: dict[str, Any]) -> types.CallToolResult:
    """The answer as JSON text (what every client shows) and structured, with a link to each finished take."""
    content: list[types.ContentBlock] = [types.TextContent(text=json.dumps(body, ensure_ascii=False))]
    for take in body.get("takes", []):
        content.append(
            types.ResourceLink(
                uri=take["resource"],
                name=f"take {take['index']}",
                mime_type="audio/mpeg",
                description=f"the MP3; over HTTP: {take['mp3_url']}",
            )
        )
    return types.CallToolResult(content=content, structured_content=body)


class Services(Protocol):
    """What the tools use of a running dispatcher's parts (``compose.Parts`` has them)."""

    jobs: JobService
    uploads: UploadService
    tags: dict[str, dict[str, Any]]
    adapters: AdapterService


class McpServer:
    """The tools and resources over one dispatcher's job and upload services, served at ``/mcp``.

    ``services``: the running dispatcher's, asked per request (they are made in the app's lifespan)."""

    def __init__(self, s: DispatcherSettings, services: Callable[[], Services]) -> None:
        self.s, self.services = s, services
        self.specs = {spec.name: spec for spec in tool_specs(s)}
        self.tools = [tool(spec) for spec in self.specs.values()]
        self.server: Server[Any] = Server(
            "songserve",
            version=__version__,
            title="songserve",
            instructions=INSTRUCTIONS,
            get_tool_input_schema=lambda name: (
                self.specs[name].arguments.model_json_schema() if name in self.specs else None
            ),
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_list_resource_templates=self._list_templates,
            on_read_resource=self._read_resource,
        )
        local = s.host in ("127.0.0.1", "localhost", "::1")  # a DNS-rebinding page could reach a loopback server
        origins = [f"http://{h}:*" for h in LOOPBACK] + [o.strip() for o in s.cors_origins.split(",") if o.strip()]
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=local,
            allowed_origins=origins,
            allowed_hosts=[*LOOPBACK, *(f"{h}:*" for h in LOOPBACK)],
        )
        self.manager = StreamableHTTPSessionManager(
            self.server, stateless=True, security_settings=security, max_request_body_size=body_limit(s)
        )
        self._large = asyncio.Semaphore(s.upload_concurrency)  # bodies over MAX_BODY_BYTES being read at once

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Within the dispatcher's lifespan: the transport's task group."""
        async with self.manager.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope["headers"]).get(b"content-length", b"")
        small = scope["method"] != "POST" or (length.isdigit() and int(length) <= self.s.max_body_bytes)
        if small:
            return await self.manager.handle_request(scope, receive, send)
        if self._large.locked():
            log.warning(
                "mcp: a large message refused: %d are being read (UPLOAD_CONCURRENCY) (503)", self.s.upload_concurrency
            )
            return await send_error(
                send,
                503,
                f"{self.s.upload_concurrency} large MCP messages are being read "
                "(UPLOAD_CONCURRENCY); try again shortly.",
                [(b"retry-after", str(RETRY_AFTER_SEC).encode())],
            )
        async with self._large:
            await self.manager.handle_request(scope, receive, send)

    # ---- the handlers ---------------------------------------------------------------------------
    def _who(self, ctx: ServerRequestContext[Any, Any]) -> tuple[Caller | None, str]:
        """The caller ``KeyAuth`` named (None without keys) and the dispatcher's URL as the caller reached it."""
        request = ctx.request
        if request is None:
            return None, ""
        caller: Caller | None = request.scope.get(CALLER)
        return caller, str(request.base_url).rstrip("/")

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools)

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        spec = self.specs.get(params.name)
        if spec is None:
            return refused(f"Unknown tool {params.name[:100]!r}; the tools are {', '.join(self.specs)}.")
        caller, base = self._who(ctx)

        async def progress(percent: float, line: str) -> None:
            await ctx.session.report_progress(percent, 100.0, line)

        got = self.services()
        call = Call(got.jobs, got.uploads, caller, base, got.tags, progress, got.adapters)
        try:
            args = spec.arguments.model_validate(params.arguments or {})
            body = await CALLS[spec.name](call, args)
        except ValidationError as exc:
            return refused(validation_message(exc.errors()))
        except SongserveError as exc:
            return refused(str(exc))
        except Exception:
            log.exception("mcp: tool %s failed%s", spec.name, f" (key {caller.name})" if caller else "")
            return refused(INTERNAL)
        return answered(body)

    async def _list_templates(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=TEMPLATES)

    def _reader(self, ctx: ServerRequestContext[Any, Any]) -> Reader:
        caller, base = self._who(ctx)
        return Reader(self.services().jobs, caller, base, max_audio_bytes(self.s))

    async def _list_resources(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=await self._reader(ctx).recent())

    async def _read_resource(
        self, ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        try:
            return await self._reader(ctx).read(str(params.uri))
        except NotFoundError as exc:
            raise MCPError(RESOURCE_NOT_FOUND, str(exc)) from None
        except SongserveError as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        except Exception:
            log.exception("mcp: reading %s failed", str(params.uri)[:200])
            raise MCPError(types.INTERNAL_ERROR, INTERNAL) from None


def body_limit(s: DispatcherSettings) -> int:
    """The largest ``/mcp`` body: an ``upload_audio`` call's base64 of ``MCP_MAX_MB``, its JSON-RPC envelope, and
    never less than any other route's ``MAX_BODY_BYTES``."""
    return max(s.max_body_bytes, 4 * -(-max_audio_bytes(s) // 3) + 64 * 1024)


def too_large(s: DispatcherSettings) -> str:
    return (
        f"The MCP message is larger than {body_limit(s)} bytes (an upload_audio file: MCP_MAX_MB, {s.mcp_max_mb:g} MB)."
    )
