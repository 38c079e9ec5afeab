"""The audit stream of a worker: its `worker` id in every event, each line one write().

Workers share one audit file. It is opened with O_APPEND and every event is handed to the kernel
in a single write() of the whole line: the kernel places each append at the end of the file
under the inode's lock, so lines of different workers never interleave or overwrite each other
(a short write, which on a regular file means the disk is full, is finished by further writes;
the error after it marks the log unhealthy and the gate fails closed as in one process).
Without --audit the workers' stdout is a pipe to the supervisor, which copies whole lines to its
own stdout (supervisor.py), since a pipe keeps writes whole only up to PIPE_BUF bytes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

from sandgate.audit import AuditLog

WORKER = "worker"


class AppendLines:
    """A write-only text sink that passes each write() to the kernel in one os.write call.

    AuditLog's structlog logger writes one event as one string ending in a newline, so one
    event is one append."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def write(self, text: str) -> int:
        data = text.encode("utf-8")
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered."""

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class WorkerAuditLog(AuditLog):
    """AuditLog whose every event names the worker that wrote it (right after `event`)."""

    def __init__(self, audit_file: Path | None, worker: int, *,
                 instance: str | None = None) -> None:
        self._file = AppendLines(audit_file) if audit_file is not None else None
        stream: TextIO = self._file if self._file is not None else sys.stdout  # type: ignore[assignment]
        super().__init__(stream, instance=instance)
        self.worker = worker

    def emit(self, event: str, **fields: Any) -> None:
        super().emit(event, **{WORKER: self.worker}, **fields)

    def close(self) -> None:
        super().close()
        if self._file is not None:
            self._file.close()
