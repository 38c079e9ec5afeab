"""No client can starve the others: what an unidentified client connection may hold, and how long.

A client connection takes one of the process's `--max-connections` slots from accept on, but
its identity is known only from its CONNECT or first request. Before that it is nobody's, and
mitmproxy itself would let it sit for the idle timeout (300 s) and renew it with one byte. So,
until the connection is identified (`identified`, from the gate's connection count):

- `first_byte_timeout`: from accept to the client's first byte;
- `handshake_timeout`: from accept to the end of the TLS handshake, when the client speaks TLS
  to Sandgate itself (`curl --proxy https://`, a TLS gateway);
- `identify_timeout`: from accept to the first identified CONNECT or request, whatever the
  client sends meanwhile (this is the longest an unidentified client holds a slot);
- `max_unidentified_per_source` (sandgate.limits.ConnectionCounter): connections one source
  address may hold open before identification; past it a new one is closed at accept.

A connection over a deadline is closed without an answer (nothing was asked that could be
answered) and audited as a `limit` event with code `handshake_timeout`. Once identified, the
per-identity limits, the head timeout and the idle timeout apply as before.

One timer per deadline and connection (`loop.call_later`), cancelled when the connection ends;
the check reads two flags, so an identified connection costs nothing afterwards.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy import connection
from mitmproxy.proxy import server

from sandgate.errors import Code
from sandgate.limits import Limiter, LimitsConfig
from sandgate.netguard import unmap

log = logging.getLogger("sandgate")

_MARK = "_sandgate_admission"

# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


SPOKE = "_sg_client_spoke"  # set on a ConnectionHandler once its client sent a byte (relay.py)

# (code, reason, client) -> None: where a closed connection is audited
OnClose = Callable[[Code, str, connection.Client], None]


@dataclass
class _State:
    limits: LimitsConfig
    on_close: OnClose


_state = _State(LimitsConfig(), lambda _c, _r, _cl: None)
# client connection ids identified since accept; an id leaves when its handler ends
_identified: set[str] = set()


def source_of(client: connection.Client) -> str:
    """The source address a connection counts under (an IPv4-mapped address as IPv4)."""
    host = str(client.peername[0]) if client.peername else ""
    try:
        return str(unmap(ipaddress.ip_address(host.split("%", 1)[0])))
    except ValueError:
        return host


def admit(limiter: Limiter, client: connection.Client) -> str | None:
    """Count a new client connection: None when it may stay, else why it is closed at once."""
    source = source_of(client)
    if limiter.connected(client.id, source):
        return None
    if limiter.over_source(source):
        return (f"address {source} has {limiter.config.max_unidentified_per_source} "
                "connections open that have not been identified yet "
                "(--max-unidentified-per-source)")
    return (f"Sandgate has {limiter.config.max_connections} client connections open "
            "(--max-connections)")


def identified(client: connection.Client) -> None:
    """The connection's CONNECT or request was identified: no admission deadline applies."""
    _identified.add(client.id)


def is_identified(client: connection.Client) -> bool:
    return client.id in _identified


def overdue(handler: Any, deadline: str) -> str | None:
    """Why the connection of `handler` must close at `deadline`, or None when it may stay."""
    client = handler.client
    if client.id in _identified:
        return None
    limits = _state.limits
    if deadline == "first_byte" and not getattr(handler, SPOKE, False):
        return f"the client sent nothing within {limits.first_byte_timeout:g}s of connecting"
    if deadline == "handshake" and client.tls and not client.tls_established:
        return (f"the client's TLS handshake did not end within "
                f"{limits.handshake_timeout:g}s of connecting")
    if deadline == "identify":
        return (f"the connection was not identified (no CONNECT or request with a valid "
                f"identity) within {limits.identify_timeout:g}s of connecting")
    return None


def _check(handler: Any, deadline: str) -> None:
    try:
        reason = overdue(handler, deadline)
        if reason is None:
            return
        io = handler.transports.get(handler.client)
        task = io.handler if io is not None else None
        if task is None or task.done():
            return  # not started (refused at accept) or already over
        handler.client.error = f"sandgate: {reason}"
        _state.on_close(Code.HANDSHAKE_TIMEOUT, reason, handler.client)
        task.cancel()  # as mitmproxy's own idle timeout closes a connection
    except Exception:
        log.exception("sandgate: admission check failed")


def _arm(handler: Any) -> list[asyncio.TimerHandle]:
    limits = _state.limits
    loop = asyncio.get_running_loop()
    return [loop.call_later(seconds, _check, handler, deadline)
            for deadline, seconds in (("first_byte", limits.first_byte_timeout),
                                      ("handshake", limits.handshake_timeout),
                                      ("identify", limits.identify_timeout))
            if seconds]


def _wrap_handle_client(original: Any) -> Any:
    async def handle_client(self: Any) -> None:
        timers = _arm(self) if self.client.transport_protocol == "tcp" else []
        try:
            await original(self)
        finally:
            for t in timers:
                t.cancel()
            _identified.discard(self.client.id)

    return handle_client


def install(limits: LimitsConfig, on_close: OnClose | None = None) -> None:
    """Idempotent; takes the latest limits."""
    _state.limits = limits
    if on_close is not None:
        _state.on_close = on_close
    cls = server.ConnectionHandler
    if getattr(cls, _MARK, False):
        return
    cls.handle_client = _wrap_handle_client(cls.handle_client)  # type: ignore[method-assign]
    setattr(cls, _MARK, True)


def installed() -> bool:
    return bool(getattr(server.ConnectionHandler, _MARK, False))
