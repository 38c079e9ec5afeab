"""A GitHub-like MCP server (the official Python SDK, streamable HTTP) for the MCP tests.

Run as a process of its own (the SDK is in the `clients` extra of the dev environment):
    python server.py HOST PORT CERT KEY json|sse [PAGE_SIZE]
It speaks both protocol eras (2025's initialize sessions, 2026-07-28's stateless requests).
With PAGE_SIZE, tools/list answers in pages of that many tools (nextCursor: the next offset),
and every tools/list result is marked cacheable by anyone (ttlMs 60000, cacheScope public), as
a server that lists the same tools to every caller may: Sandgate narrows what it filtered.
Every tool checks the bearer token Sandgate injects (MCP_EXPECTED_TOKEN); `get_me` reflects the
Authorization header it received, so the tests can see that Sandgate scrubs it from the result.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import uvicorn
from mcp.server.caching import CacheHint
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ListToolsResult

EXPECTED = "Bearer " + os.environ["MCP_EXPECTED_TOKEN"]
PAGE = int(sys.argv[6]) if __name__ == "__main__" and len(sys.argv) > 6 else 0


class PagedServer(MCPServer):
    """tools/list in pages of PAGE tools (0: all at once); the cursor is the next offset."""

    async def _handle_list_tools(self, ctx: Any, params: Any) -> ListToolsResult:
        tools = await self.list_tools()
        if not PAGE:
            return ListToolsResult(tools=tools)
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + PAGE
        return ListToolsResult(tools=tools[start:end],
                               next_cursor=str(end) if end < len(tools) else None)


server = PagedServer("github-like",
                     cache_hints={"tools/list": CacheHint(ttl_ms=60000, scope="public")})


def _check(ctx: Context) -> None:
    got = (ctx.headers or {}).get("authorization")
    if got != EXPECTED:
        raise ValueError("bad or missing bearer token")


@server.tool()
def list_issues(repo: str, ctx: Context) -> str:
    """List the open issues of a repository."""
    _check(ctx)
    return f"issues of {repo}: #1, #2"


@server.tool()
def get_issue(repo: str, number: int, ctx: Context) -> str:
    """One issue."""
    _check(ctx)
    return f"{repo}#{number}: it is broken"


@server.tool()
def get_me(ctx: Context) -> str:
    """Who the token belongs to (reflects the Authorization header: scrubbed by Sandgate)."""
    _check(ctx)
    return f"you are octo, authorised with {(ctx.headers or {}).get('authorization')}"


@server.tool()
def create_issue(repo: str, title: str, ctx: Context) -> str:
    """Open an issue."""
    _check(ctx)
    return f"created {repo}#3: {title}"


@server.tool()
def delete_repo(repo: str, ctx: Context) -> str:
    """Delete a repository (nobody should be allowed this)."""
    _check(ctx)
    return f"DELETED {repo}"


@server.tool()
def search_code(query: str, ctx: Context) -> str:
    """Search code."""
    _check(ctx)
    return f"3 hits for {query}"


if __name__ == "__main__":
    host, port, cert, key, mode = sys.argv[1:6]
    app = server.streamable_http_app(json_response=mode == "json", host="mcp.test")
    uvicorn.run(app, host=host, port=int(port), ssl_certfile=cert, ssl_keyfile=key,
                log_level="warning")
