"""Test shim, loaded by the proxy process only when tests/integration/test_upstream_reset.py
puts this directory on its PYTHONPATH: a busy event loop, made certain.

For dials to addresses starting with $SANDGATE_TEST_SLOW_DIAL, the event loop's
`_connect_sock` (the TCP connect inside `loop.create_connection`) returns 200 ms late, after the
connect completed and before asyncio builds the transport. That is where a loaded loop gets
preempted by other clients' work; an upstream that resets at accept has its RST there by then.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

_PREFIX = os.environ.get("SANDGATE_TEST_SLOW_DIAL")

if _PREFIX:
    from asyncio import base_events

    _original = base_events.BaseEventLoop._connect_sock

    async def _connect_sock(self: Any, exceptions: Any, addr_info: Any,
                            local_addr_infos: Any = None) -> Any:
        sock = await _original(self, exceptions, addr_info, local_addr_infos)
        if str(addr_info[4][0]).startswith(_PREFIX):
            await asyncio.sleep(0.2)
            print(f"slowdial: held the dial of {addr_info[4][0]}", file=sys.stderr, flush=True)
        return sock

    base_events.BaseEventLoop._connect_sock = _connect_sock  # type: ignore[method-assign]
