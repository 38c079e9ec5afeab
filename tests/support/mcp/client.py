"""The official Python MCP SDK as a client, through Sandgate (run from .venv-clients).

    python client.py URL STEPS_JSON
STEPS_JSON is a list of ["list"] or ["call", NAME, {ARGS}]; one JSON line per step is printed:
{"tools": [...]} or {"text": ...} or {"error": MESSAGE, "data": ...} (an MCPError raised)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError


async def main(url: str, steps: list[list[Any]]) -> None:
    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as s:
        await s.initialize()
        for step in steps:
            try:
                if step[0] == "list":
                    tools = await s.list_tools()
                    out: dict[str, Any] = {"tools": sorted(t.name for t in tools.tools)}
                else:
                    res = await s.call_tool(step[1], step[2])
                    text = " ".join(getattr(c, "text", "") for c in res.content)
                    out = {"text": text, "is_error": bool(res.is_error)}
            except MCPError as e:
                out = {"error": e.message, "code": e.code, "data": e.data}
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
