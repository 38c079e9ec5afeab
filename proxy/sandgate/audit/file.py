"""The audit file: appended one line per write(), rotated by size or age, old files dropped.

Every line is handed to the kernel in one write() on an O_APPEND descriptor (several worker
processes may share the file: sandgate.audit.workerlog). With rotation on (--audit-max-bytes,
--audit-max-age), writers take an flock on `FILE.lock` around each line: the writer that finds
the file due renames it to `FILE.<UTC time>` (`audit.jsonl.20261124T120501.123456Z`: names that
never change later, so records that name a file stay true, and that sort in time order) and
starts a new FILE; the others notice the new inode under the same lock and reopen before their
next line, so no line lands in a file after it was rotated. With --audit-keep N only the N
newest rotated files are kept; the writer that drops one records its name and the hash of its
last line in the new file (sandgate.audit.events: the `retention` event), so a verifier of the kept
files knows where they begin.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sandgate.audit.chain import last_line_hash


@dataclass(frozen=True)
class Rotation:
    max_bytes: int | None = None  # rotate before a line would take the file past this size
    max_age: float | None = None  # seconds: rotate the first line after the file is this old
    keep: int | None = None  # rotated files kept (None: all)

    @property
    def on(self) -> bool:
        return self.max_bytes is not None or self.max_age is not None


@dataclass(frozen=True)
class Rotated:
    """What one rotation did: for the `rotate` and `retention` events of the new file."""

    previous: str  # the rotated file's new name (base name)
    previous_last: str  # hash of its last line
    dropped: tuple[tuple[str, str], ...]  # (name, hash of last line) deleted by --audit-keep


def rotated_name(path: Path, when: float) -> str:
    stamp = datetime.fromtimestamp(when, UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{path.name}.{stamp}"


def rotated_files(path: Path) -> list[Path]:
    """The rotated files of `path`, oldest first."""
    pattern = re.compile(re.escape(path.name) + r"\.\d{8}T\d{6}\.\d{6}Z(?:-\d+)?")
    return sorted((p for p in path.parent.iterdir() if pattern.fullmatch(p.name)),
                  key=lambda p: p.name)


class AuditFile:
    """A write-only text sink: each write() one os.write loop on an O_APPEND descriptor."""

    def __init__(self, path: Path, rotation: Rotation | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.rotation = rotation or Rotation()
        self._clock = clock
        self._fd = -1
        self._lock_fd = -1
        self._open()
        if self.rotation.on:
            self._lock_fd = os.open(self.path.with_name(self.path.name + ".lock"),
                                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                           0o600)
        self._opened = self._clock()

    def write(self, text: str) -> int:
        view = memoryview(text.encode("utf-8"))
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""

    def fileno(self) -> int:
        return self._fd

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held around each line when rotating: one writer rotates, none writes meanwhile."""
        if self._lock_fd < 0:
            yield
            return
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            self._follow()
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _follow(self) -> None:
        """Another writer rotated the file: write to the new one."""
        try:
            current = os.stat(self.path).st_ino
        except FileNotFoundError:
            current = -1
        if current != os.fstat(self._fd).st_ino:
            os.close(self._fd)
            self._open()

    def due(self, size: int) -> bool:
        """Would a line of `size` bytes need a rotation first? (Never for an empty file.)"""
        if not self.rotation.on:
            return False
        have = os.fstat(self._fd).st_size
        if have == 0:
            return False
        r = self.rotation
        return (r.max_bytes is not None and have + size > r.max_bytes) or \
            (r.max_age is not None and self._clock() - self._opened >= r.max_age)

    def rotate(self) -> Rotated:
        """Rename the file away, start a new one, drop what --audit-keep does not keep.
        Raises OSError when the file cannot be renamed or the new one created (fail closed)."""
        last = last_line_hash(self.path)
        target = self.path.with_name(rotated_name(self.path, self._clock()))
        n = 0
        while target.exists():
            n += 1
            target = self.path.with_name(rotated_name(self.path, self._clock()) + f"-{n}")
        os.rename(self.path, target)
        os.close(self._fd)
        self._fd = -1
        self._open()
        dropped: list[tuple[str, str]] = []
        keep = self.rotation.keep
        if keep is not None:
            old = rotated_files(self.path)
            for p in old[: max(0, len(old) - keep)]:
                dropped.append((p.name, last_line_hash(p)))
                p.unlink()
        return Rotated(target.name, last, tuple(dropped))

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1
