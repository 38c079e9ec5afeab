"""Identify callers by the Docker container that owns their address.

A container on one of the watched networks is a caller if it has the label `sandgate.identity`
(required) and optionally `sandgate.sandbox` (default: the container name). The address map is
built by one listing at start() and kept current from Docker's event stream. `lookup` only reads
the current map, an immutable mapping swapped atomically: no I/O on the hot path.

Address reuse: Docker hands a freed address to the next container at once. An entry must
therefore be gone before its address can belong to someone else, or the new container would be
identified as the old one. Two threads: the reader takes events off the stream in order and
applies REMOVALS at once, from the event alone (container die/destroy, network disconnect: no
Docker call, nothing to wait for); ADDITIONS (start, connect) need the container's labels and
addresses, so a worker inspects the container and adds it unless it was removed meanwhile (a
sequence number per removal). Docker emits `die` before it releases the address, and the new
owner's `connect` after it got it, so the old entry is dropped before the new container exists,
however slow the inspections are; the address is then unknown (refused) until the new owner's
labels are read.

Fail closed: an address no running container owns is unknown (the proxy refuses it); while the
event stream is down the map is emptied, and it is rebuilt when Docker is back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import docker
import requests
from docker.errors import DockerException, NotFound

from sandgate.identity.base import Caller, SandboxEnded
from sandgate.identity.labels import LABEL_IDENTITY, LABEL_SANDBOX, LABEL_SPLIT
from sandgate.sandbox.engine import DockerUnavailable, docker_endpoint

log = logging.getLogger(__name__)

_CONTAINER_GONE = frozenset({"die", "destroy"})

# container id -> {ip: Caller} for that container on the watched networks
_Entries = dict[str, dict[str, Caller]]


def _normalise_ip(ip: str) -> str:
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


class DockerLabelSource:
    """AddressIdentitySource over running containers' labels on the given Docker networks."""

    source = "docker"
    exclusive = True  # an address no container owns is refused, token or not (docs/deployment.md)

    def __init__(
        self,
        networks: Iterable[str],
        client: docker.DockerClient | None = None,
        *,
        base_url: str | None = None,
        reconnect_delay: float = 1.0,
    ) -> None:
        self.networks = frozenset(networks)
        if not self.networks:
            raise ValueError("DockerLabelSource needs at least one network name")
        self._client = client
        self._base_url = base_url
        self._reconnect_delay = reconnect_delay
        self._map: Mapping[str, Caller] = MappingProxyType({})
        self._entries: _Entries = {}
        self._lock = threading.Lock()  # writers only; lookup never takes it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream: Any = None
        self._synced = threading.Event()
        self.generation = 0  # bumps on every map swap (tests, metrics)
        # Additions: (container id, sequence number when scheduled); None stops the worker.
        self._work: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._seq = 0  # bumps on every removal and resync (under the lock)
        self._removed: dict[str, int] = {}  # container id -> _seq of its last removal
        self._floor = 0  # _seq of the last resync: older scheduled work is void
        # Test hook: cleared, the worker's Docker calls wait (a consumer lagging behind).
        self._io_gate = threading.Event()
        self._io_gate.set()
        # Called (on the reader thread) with each sandbox whose container died: its dynamic
        # secrets are revoked (set by the runner).
        self.on_sandbox_end: SandboxEnded | None = None

    # --- hot path -------------------------------------------------------------------------------

    def lookup(self, client_ip: str) -> Caller | None:
        return self._map.get(_normalise_ip(client_ip))

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> DockerLabelSource:
        """List the containers now (synchronously), then follow the event stream in a thread.

        Raises DockerUnavailable if Docker is not reachable.
        """
        if self._thread is not None:
            return self
        client = self._connect()
        since = self._resync(client)
        self._stop.clear()
        self._worker = threading.Thread(
            target=self._work_loop, args=(client,), name="sandgate-docker-labels-inspect",
            daemon=True,
        )
        self._worker.start()
        self._thread = threading.Thread(
            target=self._run, args=(client, since), name="sandgate-docker-labels", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 5) -> None:
        self._stop.set()
        self._close_stream()
        self._work.put(None)
        for thread in (self._thread, self._worker):
            if thread is not None:
                thread.join(timeout)
        self._thread = self._worker = None

    def __enter__(self) -> DockerLabelSource:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, ip: str, present: bool = True, timeout: float = 10) -> Caller | None:
        """Poll until `ip` is (or is no longer) mapped; for tests and startup scripts."""
        deadline = time.monotonic() + timeout
        while True:
            caller = self.lookup(ip)
            if (caller is not None) == present or time.monotonic() >= deadline:
                return caller
            time.sleep(0.05)

    # --- internals ------------------------------------------------------------------------------

    def _connect(self) -> docker.DockerClient:
        where = docker_endpoint(self._base_url)
        try:
            client = self._client
            if client is None:
                client = (
                    docker.DockerClient(base_url=self._base_url)
                    if self._base_url
                    else docker.from_env()
                )
            client.ping()
            return client
        except (DockerException, requests.RequestException) as exc:
            raise DockerUnavailable(
                f"Docker is not running or not reachable at {where}: {exc}"
            ) from exc

    def _resync(self, client: docker.DockerClient) -> int:
        """Rebuild the whole map from one listing. Returns the time to replay events from."""
        since = int(time.time()) - 1
        try:
            listed = client.api.containers(filters={"network": sorted(self.networks)})
        except (DockerException, requests.RequestException) as exc:
            raise DockerUnavailable(
                f"Docker is not running or not reachable at {docker_endpoint(self._base_url)}: "
                f"{exc}"
            ) from exc
        entries: _Entries = {}
        for summary in listed:
            if summary.get("State") not in (None, "running"):
                continue
            name = (summary.get("Names") or ["/" + summary["Id"][:12]])[0].lstrip("/")
            nets = (summary.get("NetworkSettings") or {}).get("Networks") or {}
            found = self._entries_for(summary["Id"], name, summary.get("Labels") or {}, nets)
            if found:
                entries[summary["Id"]] = found
        with self._lock:
            self._seq += 1
            self._floor = self._seq
            self._removed = {}
            self._entries = entries
            self._publish()
        self._synced.set()
        log.info("docker identity map: %d addresses on %s", len(self._map),
                 ", ".join(sorted(self.networks)))
        return since

    def _entries_for(self, cid: str, name: str, labels: Mapping[str, str],
                     networks: Mapping[str, Any]) -> dict[str, Caller]:
        on_watched = {n: v for n, v in networks.items() if n in self.networks}
        if not on_watched:
            return {}
        identity = labels.get(LABEL_IDENTITY)
        if not identity:
            log.warning("container %s (%s) on %s has no %s label: its address is not mapped",
                        name, cid[:12], ", ".join(sorted(on_watched)), LABEL_IDENTITY)
            return {}
        caller = Caller(identity, labels.get(LABEL_SANDBOX) or name, self.source,
                        split=labels.get(LABEL_SPLIT) == "uid")
        out: dict[str, Caller] = {}
        for settings in on_watched.values():
            for key in ("IPAddress", "GlobalIPv6Address"):
                ip = (settings or {}).get(key)
                if ip:
                    out[ip] = caller
        return out

    def _remove(self, cid: str, why: str) -> None:
        """Drop a container's addresses now, from the event alone (the reader thread)."""
        with self._lock:
            self._seq += 1
            self._removed[cid] = self._seq
            old = self._entries.pop(cid, None)
            if old:
                self._publish()
                log.info("docker identity map: container %s (%s) unmapped: %s", cid[:12], why,
                         ", ".join(sorted(old)))
        if old and why in _CONTAINER_GONE and self.on_sandbox_end is not None:
            for caller in {c for c in old.values() if c.sandbox is not None}:
                try:
                    self.on_sandbox_end(caller, f"container_{why}")
                except Exception:
                    log.exception("docker identity source: sandbox end callback failed")

    def _schedule(self, cid: str) -> None:
        """Have the worker read the container's labels and addresses (start, connect)."""
        with self._lock:
            seq = self._seq
        self._work.put((cid, seq))

    def _work_loop(self, client: docker.DockerClient) -> None:
        while True:
            item = self._work.get()
            if item is None or self._stop.is_set():
                return
            cid, seq = item
            try:
                self._io_gate.wait()
                self._refresh_container(client, cid, seq)
            except Exception as exc:  # the reader notices a lost Docker and resyncs
                log.warning("docker identity source: cannot inspect container %s: %s",
                            cid[:12], exc)

    def _refresh_container(self, client: docker.DockerClient, cid: str, seq: int) -> None:
        try:
            attrs = client.api.inspect_container(cid)
        except NotFound:
            return
        if not (attrs.get("State") or {}).get("Running"):
            return
        cid = attrs["Id"]
        found = self._entries_for(
            cid, str(attrs.get("Name", "")).lstrip("/"),
            (attrs.get("Config") or {}).get("Labels") or {},
            (attrs.get("NetworkSettings") or {}).get("Networks") or {},
        )
        with self._lock:
            if seq < self._floor or self._removed.get(cid, -1) > seq:
                return  # removed (or resynced) after this was scheduled: stale
            old = self._entries.get(cid, {})
            if found:
                self._entries[cid] = found
            else:
                self._entries.pop(cid, None)
            if old != found:
                self._publish()
                log.info("docker identity map: container %s now %s", cid[:12],
                         {ip: c.identity for ip, c in found.items()} or "unmapped")

    def _publish(self) -> None:
        """Swap in a fresh immutable map (caller holds the lock)."""
        owners: dict[str, list[tuple[str, Caller]]] = {}
        for cid, found in self._entries.items():
            for ip, caller in found.items():
                owners.setdefault(ip, []).append((cid, caller))
        new: dict[str, Caller] = {}
        for ip, claims in owners.items():
            if len(claims) == 1:
                new[ip] = claims[0][1]
            else:  # two containers claim one address: trust neither
                log.error("address %s claimed by containers %s: not mapped", ip,
                          ", ".join(cid[:12] for cid, _ in claims))
        self._map = MappingProxyType(new)
        self.generation += 1

    def _handle(self, event: Mapping[str, Any]) -> None:
        """One event, on the reader thread: removals at once, additions to the worker."""
        kind, action = event.get("Type"), str(event.get("Action") or "")
        actor = event.get("Actor") or {}
        attrs = actor.get("Attributes") or {}
        if kind == "container":
            cid = actor.get("ID") or event.get("id")
            if not cid:
                return
            if action in _CONTAINER_GONE:
                self._remove(cid, action)
            elif action == "start":
                self._schedule(cid)
        elif kind == "network" and attrs.get("name") in self.networks:
            cid = attrs.get("container")
            if not cid:
                return
            if action == "disconnect":  # its other watched networks come back via the worker
                self._remove(cid, f"disconnected from {attrs.get('name')}")
                self._schedule(cid)
            elif action == "connect":
                self._schedule(cid)

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close()
            except Exception:  # noqa: S110 - closing a dead socket; nothing to do
                pass

    def _run(self, client: docker.DockerClient, since: int) -> None:
        while not self._stop.is_set():
            try:
                self._stream = client.events(
                    decode=True, since=since,
                    filters={"type": ["container", "network"]},
                )
                for event in self._stream:
                    if self._stop.is_set():
                        break
                    self._handle(event)
                    since = int(event.get("time") or since)
                if self._stop.is_set():
                    break
                raise DockerUnavailable("the Docker event stream ended")
            except Exception as exc:
                if self._stop.is_set():
                    break
                self._close_stream()
                log.error("docker identity source lost Docker (%s); refusing docker-identified "
                          "callers until it is back", exc)
                with self._lock:
                    self._seq += 1
                    self._floor = self._seq
                    self._entries = {}
                    self._publish()
                while not self._stop.wait(self._reconnect_delay):
                    try:
                        client.ping()
                        since = self._resync(client)
                        break
                    except Exception as again:
                        log.debug("docker still unavailable: %s", again)
