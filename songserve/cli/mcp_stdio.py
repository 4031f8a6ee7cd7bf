"""``songserve mcp``: an MCP server on standard input and output, for desktop clients that only start local ones.

It holds no tool of its own: each request (the tools, a call, the resources) is passed to the
dispatcher's ``/mcp`` over HTTP (``SONGSERVE_URL``, with ``SONGSERVE_API_KEY`` as the bearer key) with
the SDK's own client, and each answer, error and progress notification is passed back. So the local
server offers exactly what the dispatcher does, its key's scope and limits included, and a dispatcher
that gains a tool needs no new ``songserve``. Nothing but the protocol goes to standard output; a
dispatcher that cannot be reached is each call's error, naming the URL.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import anyio
import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from songserve import __version__

log = logging.getLogger("songserve.mcp")
WAIT_READ_SEC = 90.0  # a call may wait up to 60 s (wait_for_job) before it answers


class Relay:
    """The local server: every handler asks the dispatcher's ``/mcp`` through one client session."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/") + "/mcp"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client: Client | None = None
        self.server: Server[Any] = Server(
            "songserve",
            version=__version__,
            instructions=f"songserve at {url}: make songs from a style and lyrics (relayed to its /mcp).",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_list_resource_templates=self._list_templates,
            on_read_resource=self._read_resource,
        )

    async def _remote(self) -> Client:
        if self.client is None:
            raise MCPError(types.INTERNAL_ERROR, f"Cannot reach the dispatcher at {self.url}.")
        return self.client

    async def _list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return await (await self._remote()).list_tools()

    async def _call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        async def relay(progress: float, total: float | None, message: str | None) -> None:
            await ctx.session.report_progress(progress, total, message)

        remote = await self._remote()
        try:
            return await remote.call_tool(params.name, params.arguments or {}, progress_callback=relay)
        except MCPError as exc:
            return types.CallToolResult(content=[types.TextContent(text=exc.message)], is_error=True)

    async def _list_resources(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        return await (await self._remote()).list_resources()

    async def _list_templates(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return await (await self._remote()).list_resource_templates()

    async def _read_resource(
        self, ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        return await (await self._remote()).read_resource(str(params.uri))

    async def serve(self) -> None:
        """Connect to the dispatcher, then serve standard input until it closes."""
        timeout = httpx2.Timeout(30.0, read=WAIT_READ_SEC)
        async with httpx2.AsyncClient(headers=self.headers, timeout=timeout) as http:
            async with Client(streamable_http_client(self.url, http_client=http)) as client:
                self.client = client
                async with stdio_server() as (read, write):
                    await self.server.run(read, write, self.server.create_initialization_options())


def main(url: str, api_key: str | None) -> int:
    """``songserve mcp``: 0 when standard input closes; 1 (and one line on standard error) when the
    dispatcher cannot be reached or refuses the key."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="songserve mcp: %(message)s")
    failed: list[BaseException] = []
    try:
        anyio.run(Relay(url, api_key).serve)
    except* (httpx2.HTTPError, MCPError, OSError) as group:
        failed.extend(group.exceptions)
    if failed:
        print(f"error: cannot serve the dispatcher's MCP server at {url}/mcp: {failed[0]}", file=sys.stderr)
    return 1 if failed else 0
