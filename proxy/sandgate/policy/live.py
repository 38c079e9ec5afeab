"""The serving policy, and reloading it while the proxy runs.

A reload builds and validates the whole new policy first (in a worker thread), then swaps it in
with one assignment on the event loop: a flow is judged by the one policy it read at its first
hook, so nothing ever sees a half-built policy. A policy that fails to load never takes effect;
the last good one keeps serving and the problems (file:line: field: message. Fix: ...) are kept
for `/readyz`, logged and reported to every outcome listener (audit, metrics).

The directory is watched by polling names, sizes, mtimes and inodes every `interval` seconds,
with a debounce of one more interval: cheap for a handful of files, no extra dependency, and it
sees the symlink swaps of Kubernetes ConfigMap volumes and editors' rename-into-place, which
inotify watches on the files themselves miss.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandgate.policy.loader import PolicyError, PolicyProblem, load_policy_dir
from sandgate.policy.model import Policy

log = logging.getLogger("sandgate.policy")

Fingerprint = tuple[tuple[str, int, int, int], ...]


def policy_files(directory: Path) -> list[Path]:
    """The files load_policy_dir reads, in its order."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    return sorted(p for p in entries if p.suffix in (".yaml", ".yml")
                  and not p.name.startswith(".") and p.is_file())


def fingerprint(directory: Path) -> Fingerprint:
    out: list[tuple[str, int, int, int]] = []
    for p in policy_files(directory):
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append((p.name, st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


def content_hash(files: list[Path]) -> str:
    """The policy version: sha256 over the file names and bytes, first 16 hex digits."""
    h = hashlib.sha256()
    for p in files:
        try:
            data = p.read_bytes()
        except OSError:
            data = b""
        h.update(p.name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class LoadedPolicy:
    policy: Policy
    version: str  # content hash of the files it was built from
    loaded_at: float  # wall clock (time.time())
    files: tuple[str, ...]


def load(directory: Path) -> LoadedPolicy:
    """Build and validate a policy from a directory; raises PolicyError."""
    files = policy_files(directory)
    version = content_hash(files)
    policy = load_policy_dir(directory)
    return LoadedPolicy(policy, version, time.time(), tuple(policy.files))


@dataclass(frozen=True)
class ReloadOutcome:
    outcome: str  # "ok" (swapped), "unchanged" (same content), "error" (kept the old one)
    trigger: str  # "file", "signal", "api", "start"
    version: str  # the version serving after this attempt
    previous: str
    at: float
    problems: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {"outcome": self.outcome, "trigger": self.trigger, "version": self.version,
                "previous": self.previous, "at": self.at, "problems": list(self.problems)}


@dataclass
class LivePolicy:
    directory: Path
    current: LoadedPolicy
    # called on the event loop with the new policy, before anything is judged by it
    on_swap: list[Callable[[LoadedPolicy], None]] = field(default_factory=list)
    # called after every reload attempt (audit event, metric, log)
    on_outcome: list[Callable[[ReloadOutcome], None]] = field(default_factory=list)
    last: ReloadOutcome | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _seen: Fingerprint = ()

    def __post_init__(self) -> None:
        self._seen = fingerprint(self.directory)

    @property
    def policy(self) -> Policy:
        return self.current.policy

    @property
    def problems(self) -> tuple[str, ...]:
        """The problems of the last reload attempt, if it failed (the old policy serves)."""
        return self.last.problems if self.last is not None and self.last.outcome == "error" \
            else ()

    async def reload(self, trigger: str) -> ReloadOutcome:
        async with self._lock:
            fp = fingerprint(self.directory)
            previous = self.current
            try:
                new = await asyncio.to_thread(load, self.directory)
            except PolicyError as e:
                outcome = ReloadOutcome("error", trigger, previous.version, previous.version,
                                        time.time(), tuple(str(p) for p in e.problems))
            except Exception as e:  # never let a reload take the proxy down
                log.exception("policy reload failed unexpectedly")
                outcome = ReloadOutcome("error", trigger, previous.version, previous.version,
                                        time.time(), (str(PolicyProblem(
                                            str(self.directory), 0, "",
                                            f"unexpected error: {type(e).__name__}",
                                            "see the log")),))
            else:
                if new.version == previous.version:
                    outcome = ReloadOutcome("unchanged", trigger, previous.version,
                                            previous.version, time.time())
                else:
                    for fn in self.on_swap:  # e.g. broker.update_secrets, gate.set_policy
                        fn(new)
                    self.current = new
                    outcome = ReloadOutcome("ok", trigger, new.version, previous.version,
                                            new.loaded_at)
            self._seen = fp
            self.last = outcome
            for cb in self.on_outcome:
                try:
                    cb(outcome)
                except Exception:
                    log.exception("policy reload listener failed")
            return outcome

    async def watch(self, interval: float = 0.5) -> None:
        """Reload when the directory's files change, once they have been still for `interval`."""
        pending: Fingerprint | None = None
        while True:
            await asyncio.sleep(interval)
            try:
                fp = await asyncio.to_thread(fingerprint, self.directory)
                if fp == self._seen:
                    pending = None
                    continue
                if fp != pending:
                    pending = fp  # changed: wait until it stops changing (debounce)
                    continue
                pending = None
                await self.reload("file")
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("policy watcher failed; retrying")
