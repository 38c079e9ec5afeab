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

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sandgate.audit.chain import Chain
from sandgate.audit.events import AuditLog
from sandgate.audit.file import AuditFile, Rotation

if TYPE_CHECKING:
    from sandgate.audit.anchor import Anchor

WORKER = "worker"


# One write() per line on an O_APPEND descriptor (rotation under an flock: audit/file.py).
AppendLines = AuditFile


class WorkerAuditLog(AuditLog):
    """AuditLog whose every event names the worker that wrote it (right after `event`)."""

    def __init__(self, audit_file: Path | None, worker: int, *,
                 instance: str | None = None, format: str = "json",
                 chain: Chain | None = None, rotation: Rotation | None = None,
                 anchor: Anchor | None = None) -> None:
        self._append = AuditFile(audit_file, rotation) if audit_file is not None else None
        stream: TextIO = self._append if self._append is not None else sys.stdout  # type: ignore[assignment]
        super().__init__(stream, instance=instance, format=format, chain=chain,
                         anchor=anchor)
        self.worker = worker
        self._context[WORKER] = worker  # the audit log's own lines (checkpoints) too

    def emit(self, event: str, **fields: Any) -> None:
        super().emit(event, **{WORKER: self.worker}, **fields)

    def close(self) -> None:
        super().close()
        if self._append is not None:
            self._append.close()
