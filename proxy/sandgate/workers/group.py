"""What the admin side asks of the group of `--workers N` (the supervisor has it): a protocol.

The workers' front, the console's WorkersSource and the approvals' fan-out ask the workers
through these few calls; they name this protocol, not the supervisor, which starts them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from sandgate.workers.aggregate import Readiness

# one worker's answer over its control socket: (status, body, content type)
Answer = tuple[int, bytes, str]


class Worker(Protocol):
    @property
    def running(self) -> bool: ...

    @property
    def started(self) -> bool: ...


class WorkerGroup(Protocol):
    """The supervisor's side the admin API sees (sandgate.workers.supervisor.Supervisor)."""

    @property
    def n(self) -> int: ...

    @property
    def workers(self) -> Sequence[Worker]: ...

    async def readiness(self) -> Readiness: ...

    async def metrics(self) -> bytes: ...

    async def reload_all(self) -> tuple[int, dict[str, Any]]: ...

    async def end_sandbox_all(self, sandbox: str) -> tuple[int, dict[str, Any]]: ...

    async def ask_one(self, method: str, path: str, body: bytes | None,
                      content_type: str | None) -> Answer | None: ...

    async def ask_all(self, method: str, path: str, body: bytes | None = None,
                      extra: Mapping[str, str] | None = None) -> list[Answer]: ...

    async def tell_all(self, method: str, path: str, body: bytes | None = None,
                       attempts: int = 3) -> list[int]: ...

    async def ask_until(self, method: str, path: str, body: bytes | None = None,
                        extra: Mapping[str, str] | None = None) -> Answer | None: ...
