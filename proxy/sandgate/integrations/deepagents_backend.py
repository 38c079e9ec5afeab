"""A deepagents sandbox backend whose tools run in a Sandgate sandbox (pattern 2).

The agent (its LLM loop, its memory) runs outside, on the agent host; every shell and file tool
call deepagents makes (`execute`, `ls`, `read_file`, `write_file`, `edit_file`, `glob`, `grep`)
runs inside a `sandgate.sandbox.Sandbox`: a container on the internal sandbox network whose only
way out is Sandgate, which holds no secret::

    from deepagents import create_deep_agent
    from sandgate.integrations.deepagents_backend import SandgateSandboxBackend
    from sandgate.sandbox import SandboxSpec, connect, ensure_network

    client = connect()
    spec = SandboxSpec(identity="bash-tool", proxy_url=f"http://{ensure_network(client)}:8080",
                       ca_pem=ca_pem, token=token)
    with SandgateSandboxBackend.create(client, spec) as backend:
        agent = create_deep_agent(model=model, backend=backend)
        agent.invoke({"messages": [{"role": "user", "content": "clone the repo and run tests"}]})

It implements deepagents' `SandboxBackendProtocol` by subclassing `BaseSandbox` (deepagents >=
0.7): `execute` runs the command with bash in the sandbox; `upload_files`/`download_files` move
bytes with the Docker archive API and check permissions as the sandbox user; deepagents builds
`ls`/`read`/`write`/`edit`/`glob`/`grep`/`delete` on those (its helpers run `python3` in the
sandbox, which the sandgate-bash-tool image has).

deepagents is no dependency of Sandgate (the image's requirements/proxy.lock has none; the dev
environment has it, for the tests): without it this module still imports, and instantiating the
backend raises ImportError.
"""

from __future__ import annotations

import io
import logging
import posixpath
import secrets
import tarfile
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from sandgate.sandbox.engine import DockerUnavailable, SandboxError
from sandgate.sandbox.launcher import ExecResult, Sandbox, SandboxSpec

if TYPE_CHECKING:
    import docker
    from deepagents.backends.protocol import (
        ExecuteResponse,
        FileDownloadResponse,
        FileUploadResponse,
    )
    from deepagents.backends.sandbox import BaseSandbox
else:
    try:
        from deepagents.backends.protocol import (
            ExecuteResponse,
            FileDownloadResponse,
            FileUploadResponse,
        )
        from deepagents.backends.sandbox import BaseSandbox
    except ImportError:  # deepagents lives in the agent host's environment, not Sandgate's
        ExecuteResponse = FileDownloadResponse = FileUploadResponse = None

        class BaseSandbox:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError(
                    "SandgateSandboxBackend needs deepagents (pip install deepagents), "
                    "installed in the agent host's venv, not in Sandgate's"
                )

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0  # seconds, when deepagents passes no timeout
MAX_TIMEOUT = 3600.0  # what timeout=0 ("no timeout") means here, and the cap of any timeout
MAX_DOWNLOAD_BYTES = 64 * 1024 * 1024
_STAGING_DIR = "/tmp"  # noqa: S108  # inside the sandbox: uploads land here, then move as the user
# Where deepagents' middleware puts what it offloads (large tool results, evicted history, blobs)
# with a plain backend: directories at the root, which the sandbox's user cannot create.
ARTIFACT_DIRS = ("/large_tool_results", "/conversation_history", "/blobs")
_DROPPED_MARK = "more bytes of output dropped]"  # sandgate.sandbox.launcher's truncation note

# Run as the sandbox's user, so a write obeys its permissions (put_archive writes as root).
_UPLOAD_SCRIPT = r"""src=$1 dst=$2
trap 'rm -f -- "$src"' EXIT
if [ -d "$dst" ]; then echo "$dst: Is a directory" >&2; exit 1; fi
mkdir -p -- "$(dirname -- "$dst")" && cat -- "$src" > "$dst"
"""
# Prints one status word; for "ok" also the resolved path (get_archive would copy a symlink).
_DOWNLOAD_CHECK_SCRIPT = r"""p=$1
if [ ! -e "$p" ]; then echo file_not_found
elif [ -d "$p" ]; then echo is_directory
elif [ ! -r "$p" ]; then echo permission_denied
else echo ok; readlink -f -- "$p"
fi
"""


def _error_code(stderr: str) -> str:
    """A deepagents FileOperationError for a shell error message, else the message itself."""
    if "Permission denied" in stderr or "Read-only file system" in stderr:
        return "permission_denied"
    if "Is a directory" in stderr:
        return "is_directory"
    if "Not a directory" in stderr or "File name too long" in stderr:
        return "invalid_path"
    return stderr.strip()[-500:] or "unknown error"


def combine_output(result: ExecResult) -> tuple[str, bool]:
    """stdout, then stderr lines prefixed `[stderr] ` (deepagents' LocalShellBackend style)."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.extend(f"[stderr] {line}" for line in result.stderr.rstrip("\n").split("\n"))
    truncated = _DROPPED_MARK in result.stdout[-200:] or _DROPPED_MARK in result.stderr[-200:]
    return "\n".join(parts), truncated


# (misc: BaseSandbox is Any where deepagents is not installed, such as the image; the dev lock
# has it, typed)
class SandgateSandboxBackend(BaseSandbox):  # type: ignore[misc, unused-ignore]
    """deepagents `SandboxBackendProtocol` on a `sandgate.sandbox.Sandbox`.

    Files persist across tool calls (one long-lived container). `create()` starts a sandbox the
    backend owns (closed by `close()` / the context manager); the constructor wraps an existing
    one, which the caller keeps owning unless `owns_sandbox=True`.
    """

    # deepagents' capture-at-source wrapper for big `execute` output needs bash + coreutils,
    # which Sandgate's images have: large output stays in the sandbox, a preview comes back.
    enable_capture_offload = True

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_timeout: float = MAX_TIMEOUT,
        workdir: str | None = None,
        login_shell: bool = False,
        owns_sandbox: bool = False,
        artifact_dirs: tuple[str, ...] = ARTIFACT_DIRS,
    ) -> None:
        """`login_shell=True` runs commands with `bash -lc`; off by default because a login
        shell's /etc/profile resets PATH (dropping e.g. the image's /opt/venv/bin).
        `artifact_dirs` are created owned by the sandbox's user, so deepagents can offload
        large tool output there (pass () to skip)."""
        super().__init__()
        if timeout <= 0 or max_timeout <= 0:
            raise ValueError("timeout and max_timeout must be positive")
        self.sandbox = sandbox
        self.timeout = float(timeout)
        self.max_timeout = float(max_timeout)
        self.workdir = workdir or sandbox.spec.workdir
        self.login_shell = login_shell
        self._owns_sandbox = owns_sandbox
        self._owner: tuple[int, int] | None = None
        if artifact_dirs:
            self._make_user_dirs(artifact_dirs)

    @classmethod
    def create(
        cls, client: docker.DockerClient, spec: SandboxSpec, **kwargs: Any
    ) -> SandgateSandboxBackend:
        """Start a sandbox for `spec` and wrap it; the backend owns (and closes) it."""
        return cls(Sandbox.create(client, spec), owns_sandbox=True, **kwargs)

    # --- SandboxBackendProtocol ----------------------------------------------------------------

    @property
    def id(self) -> str:
        return str(self.sandbox.id)

    def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        """Run `command` with bash in the sandbox's workdir. `timeout`: seconds; None means the
        backend default, 0 means the longest allowed (max_timeout)."""
        if timeout is None:
            secs = self.timeout
        elif timeout < 0:
            return ExecuteResponse(output=f"Error: timeout must be >= 0, got {timeout}")
        else:
            secs = min(float(timeout), self.max_timeout) if timeout else self.max_timeout
        argv = ["bash", "-lc" if self.login_shell else "-c", command]
        try:
            result = self.sandbox.exec(argv, timeout=secs, workdir=self.workdir)
        except (SandboxError, DockerUnavailable) as exc:
            log.warning("execute in sandbox %s failed: %s", self.id, exc)
            return ExecuteResponse(output=f"Error: {exc}", exit_code=None)
        output, truncated = combine_output(result)
        if result.timed_out:
            note = f"[sandgate: command timed out after {secs:g} s and was killed]"
            output = f"{output}\n{note}" if output else note
        return ExecuteResponse(output=output, exit_code=result.exit_code, truncated=truncated)

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        """Write each file as the sandbox's user (parents created). Partial success per file."""
        return [FileUploadResponse(path=path, error=self._upload(path, data))
                for path, data in files]

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        """Read each file (as the sandbox's user may). Partial success per file."""
        out = []
        for path in paths:
            content, error = self._download(path)
            out.append(FileDownloadResponse(path=path, content=content, error=error))
        return out

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the sandbox if this backend owns it. Idempotent."""
        if self._owns_sandbox:
            self.sandbox.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SandgateSandboxBackend({self.sandbox!r}, workdir={self.workdir!r})"

    # --- file transfer -------------------------------------------------------------------------

    def _abspath(self, path: str) -> str | None:
        if not path or "\0" in path:
            return None
        return posixpath.normpath(posixpath.join(self.workdir, path))

    def _user_ids(self) -> tuple[int, int]:
        """uid/gid the sandbox's commands run as (the owner uploaded files get)."""
        if self._owner is None:
            res = self.sandbox.exec(["sh", "-c", "id -u; id -g"], timeout=30, workdir="/")
            ids = res.stdout.split()
            if res.exit_code != 0 or len(ids) != 2:
                raise SandboxError(f"cannot tell the sandbox's user: {res.stderr.strip()}")
            self._owner = (int(ids[0]), int(ids[1]))
        return self._owner

    def _make_user_dirs(self, dirs: tuple[str, ...]) -> None:
        """Create top-level directories owned by the sandbox's user (which it cannot do itself:
        / is root's, and the sandbox has no capabilities). Best effort: logged, not raised."""
        try:
            uid, gid = self._user_ids()
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for d in dirs:
                    info = tarfile.TarInfo(posixpath.normpath(d).lstrip("/"))
                    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, uid, gid
                    tar.addfile(info)
            if not self.sandbox.container.put_archive("/", buf.getvalue()):
                raise SandboxError("put_archive refused")
        except Exception as exc:
            log.warning("could not create %s in sandbox %s: %s", ", ".join(dirs), self.id, exc)

    def _upload(self, path: str, data: bytes) -> str | None:
        dst = self._abspath(path)
        if dst is None or dst == "/":
            return "invalid_path"
        try:
            uid, gid = self._user_ids()
            staged = f".sandgate-upload-{secrets.token_hex(8)}"
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                info = tarfile.TarInfo(staged)
                info.size, info.mode, info.uid, info.gid = len(data), 0o600, uid, gid
                tar.addfile(info, io.BytesIO(data))
            if not self.sandbox.container.put_archive(_STAGING_DIR, buf.getvalue()):
                return "could not copy the file into the sandbox"
            res = self.sandbox.exec(
                ["bash", "-c", _UPLOAD_SCRIPT, "upload", f"{_STAGING_DIR}/{staged}", dst],
                timeout=60, workdir="/",
            )
        except Exception as exc:  # one file's failure must not fail the batch
            log.warning("upload of %s into sandbox %s failed: %s", dst, self.id, exc)
            return f"upload failed: {exc}"
        return None if res.exit_code == 0 else _error_code(res.stderr)

    def _download(self, path: str) -> tuple[bytes | None, str | None]:
        src = self._abspath(path)
        if src is None:
            return None, "invalid_path"
        try:
            res = self.sandbox.exec(["sh", "-c", _DOWNLOAD_CHECK_SCRIPT, "download", src],
                                    timeout=30, workdir="/")
            status, _, resolved = res.stdout.partition("\n")
            if res.exit_code != 0 or status != "ok":
                return None, status or _error_code(res.stderr)
            resolved = resolved.strip() or src
            stream, stat = self.sandbox.container.get_archive(resolved)
            if int(stat.get("size", 0)) > MAX_DOWNLOAD_BYTES:
                return None, f"file is larger than {MAX_DOWNLOAD_BYTES} bytes"
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream)), mode="r") as tar:
                for member in tar:
                    if member.isfile():
                        f = tar.extractfile(member)
                        if f is not None:
                            return f.read(), None
        except Exception as exc:  # one file's failure must not fail the batch
            log.warning("download of %s from sandbox %s failed: %s", src, self.id, exc)
            return None, f"download failed: {exc}"
        return None, "file_not_found"


__all__ = ["SandgateSandboxBackend", "combine_output"]
