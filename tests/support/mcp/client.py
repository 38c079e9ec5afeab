"""The official Python MCP SDK as a client, through Sandgate (a process of its own).

    python client.py URL STEPS_JSON
STEPS_JSON is a list of ["list"] or ["call", NAME, {ARGS}]; one JSON line per step is printed:
{"tools": [...]} or {"text": ...} or {"error": MESSAGE, "data": ...} (an MCPError raised).
"list" follows nextCursor through every page ("pages": how many). A first step ["discover"]
speaks the 2026-07-28 stateless revision (server/discover, then per-request metadata headers)
instead of opening a 2025 session with initialize; it prints {"version": ...}."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import PaginatedRequestParams


async def main(url: str, steps: list[list[Any]]) -> None:
    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as s:
        if steps and steps[0] == ["discover"]:
            found = await s.discover()
            print(json.dumps({"version": found.supported_versions}), flush=True)
            steps = steps[1:]
        else:
            await s.initialize()
        for step in steps:
            try:
                if step[0] == "list":
                    names, pages, cursor = [], 0, None
                    while True:
                        params = PaginatedRequestParams(cursor=cursor) if cursor else None
                        page = await s.list_tools(params=params)
                        names += [t.name for t in page.tools]
                        pages, cursor = pages + 1, page.next_cursor
                        if not cursor:
                            break
                    out: dict[str, Any] = {"tools": sorted(names), "pages": pages}
                else:
                    res = await s.call_tool(step[1], step[2])
                    text = " ".join(getattr(c, "text", "") for c in res.content)
                    out = {"text": text, "is_error": bool(res.is_error)}
            except MCPError as e:
                out = {"error": e.message, "code": e.code, "data": e.data}
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
