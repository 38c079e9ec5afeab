"""A worker's side of the supervisor: its control socket, and dying with the supervisor.

Each worker serves the ordinary admin API (`sandgate.admin.listener.build_app`: readiness, metrics,
policy, reload, explain, tokens) on a Unix socket in the supervisor's private run directory
(mode 0700), authenticated with a random token the supervisor made for this run and passed in
the environment (never on the command line, which `ps` shows). `/worker/status` adds what the
supervisor needs to know that the worker is up.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from sandgate.admin.listener import build_app
from sandgate.admin.process import AdminState
from sandgate.console import worker
from sandgate.console.source import LocalSource

TOKEN_ENV = "SANDGATE_WORKER_TOKEN"
SUPERVISOR_ENV = "SANDGATE_SUPERVISOR_PID"
RUN_ENV = "SANDGATE_AUDIT_RUN"  # the run's id and worker count, "RUN/N": in every checkpoint
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerRole:
    id: int
    socket: Path
    token: str = field(repr=False)
    run: str | None = None  # the supervisor's run id (the workers' checkpoints name it)
    workers: int | None = None  # how many workers the run has


def socket_path(run_dir: Path, worker: int) -> Path:
    return Path(run_dir) / f"worker-{worker}.sock"


# A Unix socket's path fits in sockaddr_un's sun_path: 108 bytes on Linux, with the final NUL.
MAX_SOCKET_PATH = 107


def make_run_dir(workers: int) -> Path:
    """A private directory (0700) for the workers' control sockets: under TMPDIR, or under /tmp
    when TMPDIR is so deep that a socket's path would not fit in a Unix address (the worker
    would fail to start with "AF_UNIX path too long")."""
    run_dir = Path(tempfile.mkdtemp(prefix="sandgate-workers-"))
    if len(os.fsencode(socket_path(run_dir, max(workers - 1, 0)))) > MAX_SOCKET_PATH:
        run_dir.rmdir()
        run_dir = Path(tempfile.mkdtemp(prefix="sgw-", dir="/tmp"))
    return run_dir


def role_from(worker_id: int, run_dir: Path) -> WorkerRole:
    token = os.environ.pop(TOKEN_ENV, "")
    if not token:
        raise ValueError("--worker-id is for the processes `sandgate run --workers N` starts")
    run, _, n = os.environ.get(RUN_ENV, "").partition("/")
    return WorkerRole(worker_id, socket_path(run_dir, worker_id), token, run or None,
                      int(n) if n.isdigit() else None)


def die_with_supervisor() -> None:
    """SIGTERM this worker (a graceful drain) when the supervisor dies, even by SIGKILL."""
    parent = os.environ.get(SUPERVISOR_ENV, "")
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if parent.isdigit() and os.getppid() != int(parent):  # it died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


async def start_control(state: AdminState, role: WorkerRole,
                        status: Callable[[], dict[str, Any]]) -> web.AppRunner:
    """Serve the admin API of this process on the worker's control socket."""
    app = build_app(state)

    async def worker_status(_: web.Request) -> web.Response:
        return web.json_response(status())

    app.router.add_get("/worker/status", worker_status)
    worker.add_routes(app, LocalSource(state, state.recent))  # the supervisor's console
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    with contextlib.suppress(FileNotFoundError):
        role.socket.unlink()  # left by a worker of the same id that crashed
    await web.UnixSite(runner, str(role.socket)).start()
    os.chmod(role.socket, 0o600)
    return runner
