"""What every replica must hear: ended sandboxes, reloads, and which policy each one serves.

One `Fleet` per process (with `--state`), running two loops:

- the heartbeat (every `BEAT` seconds, the BEAT script): refreshes this process's lease (its
  connection counts stay counted while it lives, and stop counting `LEASE` seconds after it
  dies), writes the policy version it serves and reads everyone's (`/readyz`, the
  `sandgate_fleet_policy_versions` gauge), and is the probe that brings the state back after an
  outage;
- the listener (pub/sub on `<prefix>events`): `end` (a sandbox ended on another replica: its
  leases here are revoked and its cached values dropped) and `reload` (a replica reloaded
  through the API: reload here too, when the version differs).

A sandbox's end is also recorded as a key `<prefix>ended:<sandbox>` that lives as long as a
proxy token can (`--admin-max-token-ttl`), and every request of a sandbox checks it at most
`RECHECK` seconds after the last check: a replica that missed the message (its subscription
was down) still refuses the sandbox's tokens within that bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from sandgate.errors import StateUnavailable
from sandgate.state import StateConfig, open_state, scripts
from sandgate.state.health import StateHealth

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger("sandgate.state")

BEAT = 1.0  # seconds between heartbeats (and probes while the state is down)
LEASE = 10.0  # seconds a process's lease outlives its last heartbeat
RECHECK = 2.0  # seconds a sandbox is taken as live before the ended set is asked again
_MAX_CHECKED = 50_000  # sandboxes remembered as checked (bounded memory)


def process_id(instance: str) -> str:
    """This process in the fleet: replica name, host, pid and a random part (a restarted
    process with the same pid is a new one)."""
    return f"{instance}/{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


class Fleet:
    def __init__(self, cfg: StateConfig, r: aioredis.Redis, health: StateHealth, process: str,
                 ended_ttl: int, *, version: Callable[[], str] = lambda: "",
                 on_end: Callable[[str, str], Awaitable[Any]] | None = None,
                 on_reload: Callable[[], Awaitable[Any]] | None = None) -> None:
        self.cfg = cfg
        self.r = r
        self.health = health
        self.process = process
        self.ended_ttl = max(1, ended_ttl)
        self.channel = cfg.key("events")
        self._beat = r.register_script(scripts.BEAT)
        self.version = version  # the policy version this process serves
        # given by the runner: end a sandbox here (the broker), reload the policy here
        self.on_end = on_end
        self.on_reload = on_reload
        self.versions: dict[str, str] = {}  # process -> policy version (last heartbeat)
        self._ended: dict[str, float] = {}  # sandbox -> monotonic() until it is refused here
        self._checked: dict[str, float] = {}  # sandbox -> monotonic() of its last check
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._beat_loop()),
                       asyncio.ensure_future(self._listen_loop())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # gone now, not at the lease's expiry: its
            # version leaves the list and its connections stop counting
            await asyncio.wait_for(self.r.hdel(self.cfg.key("policy"), self.process),
                                   self.cfg.timeout)
            await asyncio.wait_for(self.r.delete(self.cfg.key("proc", self.process)),
                                   self.cfg.timeout)
        with contextlib.suppress(Exception):
            await self.r.aclose()

    async def beat(self) -> None:
        """One heartbeat; marks the state up or down."""
        try:
            flat = await asyncio.wait_for(self._beat(
                keys=[self.cfg.key("proc", self.process), self.cfg.key("policy")],
                args=[self.process, self.version(), int(LEASE * 1000)]), self.cfg.timeout * 4)
        except (TimeoutError, RedisError, OSError) as e:
            self.health.down(e)
            return
        self.versions = dict(zip(flat[::2], flat[1::2], strict=True))
        self.health.up()

    async def _beat_loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(BEAT)

    # ------------------------------------------------------------------ policy agreement

    def agreement(self) -> dict[str, Any]:
        """For /readyz: the versions the live processes serve, and whether they agree."""
        distinct = sorted(set(self.versions.values()))
        return {"available": self.health.available, "processes": len(self.versions),
                "policy_versions": distinct, "agree": len(distinct) <= 1,
                **({"error": self.health.last_error} if not self.health.available else {})}

    async def announce_reload(self, version: str) -> None:
        """This replica reloaded through the API: the others reload too."""
        await self._publish({"type": "reload", "version": version})

    # ------------------------------------------------------------------ sandboxes

    async def end_sandbox(self, sandbox: str, why: str) -> bool:
        """Record the sandbox as ended for the fleet and tell every replica. False when the
        state could not be reached (this replica has ended it; the others learn it from
        their own events, the token expiry, or a retried call)."""
        self._ended[sandbox] = time.monotonic() + self.ended_ttl
        try:
            await asyncio.wait_for(
                self.r.set(self.cfg.key("ended", sandbox), why, ex=self.ended_ttl),
                self.cfg.timeout)
        except (TimeoutError, RedisError, OSError) as e:
            self.health.down(e)
            return False
        return await self._publish({"type": "end", "sandbox": sandbox, "why": why})

    async def sandbox_ended(self, sandbox: str) -> bool:
        now = time.monotonic()
        until = self._ended.get(sandbox)
        if until is not None:
            if until > now:
                return True
            del self._ended[sandbox]
        seen = self._checked.get(sandbox)
        if seen is not None and now - seen < RECHECK:
            return False
        try:
            if not self.health.available:
                raise RedisError("known down")
            found = await asyncio.wait_for(self.r.exists(self.cfg.key("ended", sandbox)),
                                           self.cfg.timeout)
        except (TimeoutError, RedisError, OSError) as e:
            if self.health.available:
                self.health.down(e)
            if self.cfg.fail == "closed":
                raise StateUnavailable(f"Sandgate's shared state ({self.cfg.url.redacted()}) "
                                       "cannot say whether this sandbox has ended "
                                       "(--state-fail closed)") from None
            return False  # what this replica knows (messages it received) still holds
        if found:
            self._ended[sandbox] = now + self.ended_ttl
            return True
        if len(self._checked) >= _MAX_CHECKED:
            self._checked = {k: v for k, v in self._checked.items() if now - v < RECHECK}
        self._checked[sandbox] = now
        return False

    # ------------------------------------------------------------------ pub/sub

    async def _publish(self, message: dict[str, Any]) -> bool:
        body = json.dumps({**message, "from": self.process})
        try:
            await asyncio.wait_for(self.r.publish(self.channel, body), self.cfg.timeout)
        except (TimeoutError, RedisError, OSError) as e:
            self.health.down(e)
            return False
        return True

    async def _listen_loop(self) -> None:
        sub = open_state(self.cfg, blocking=True)
        try:
            while True:
                try:
                    async with sub.pubsub(ignore_subscribe_messages=True) as ps:
                        await ps.subscribe(self.channel)
                        async for msg in ps.listen():
                            await self.received(msg.get("data"))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the connection went: subscribe again
                    log.debug("sandgate: state subscription lost (%s)", type(e).__name__)
                    await asyncio.sleep(BEAT)
        finally:
            with contextlib.suppress(Exception):
                await sub.aclose()

    async def received(self, data: object) -> None:
        """One message of the channel (from any process, this one included)."""
        try:
            msg = json.loads(data) if isinstance(data, str) else None
        except ValueError:
            msg = None
        if not isinstance(msg, dict) or msg.get("from") == self.process:
            return
        try:
            if msg.get("type") == "end" and isinstance(msg.get("sandbox"), str):
                sandbox = msg["sandbox"]
                self._ended[sandbox] = time.monotonic() + self.ended_ttl
                if self.on_end is not None:
                    await self.on_end(sandbox, f"fleet: {msg.get('why') or 'ended'}")
            elif msg.get("type") == "reload" and self.on_reload is not None:
                if msg.get("version") != self.version():
                    await self.on_reload()
        except Exception:
            log.exception("sandgate: handling a fleet message failed")
