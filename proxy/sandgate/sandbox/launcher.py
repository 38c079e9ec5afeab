"""Run sandboxes: containers whose only way out is Sandgate.

For agent hosts (pattern 2: the agent's bash/code tool runs in a sandbox) and for the CLI::

    client = connect()
    gateway = ensure_network(client)  # the host accepts only gateway:8080 from it
    spec = SandboxSpec(identity="bash-tool", proxy_url=f"http://{gateway}:8080",
                       ca_pem=ca_pem, token=token)
    with Sandbox.create(client, spec) as sbx:
        sbx.exec("git clone https://github.com/org/repo && ls repo")
        sbx.exec(["python3", "repo/main.py"], timeout=60)

A sandbox is a long-lived container (files persist between exec calls) attached to the internal
network only, with every capability dropped, no-new-privileges, CPU/memory/pids limits, the
proxy in every proxy variable and the Sandgate CA trusted system-wide. It holds no secret: the
proxy token in the proxy URL is a short-lived credential scoped to the sandbox's identity, and
API keys are placeholders Sandgate swaps in transit.
"""

from __future__ import annotations

import io
import ipaddress
import logging
import re
import secrets
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import docker
import requests
from docker.errors import APIError, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.utils.socket import STDERR, frames_iter

from sandgate.identity.labels import LABEL_IDENTITY, LABEL_MANAGED, LABEL_SANDBOX, LABEL_SPLIT
from sandgate.proxyenv import (
    CA_BUNDLE,
    CA_DIR,
    CA_FILE,
    ENV_NAMES,
    ca_environment,
    proxy_environment,
    proxy_url_with_credentials,
)
from sandgate.sandbox.engine import SandboxError, unavailable
from sandgate.sandbox.network import NETWORK_NAME, inspect_network, restrict_host_access
from sandgate.sandbox.split import AS_AGENT, STATE_FILE, SplitPorts, container_options, wait_ready

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "sandgate-bash-tool:dev"

_RESERVED_ENV = ENV_NAMES | {"SANDGATE_IDENTITY", "SANDGATE_SANDBOX"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")
_OUTPUT_LIMIT = 4 * 1024 * 1024  # per stream; the rest is dropped (and said so)
_EXEC_GRACE = 10  # seconds past the timeout before the caller stops waiting regardless

# Run as root (with no capabilities: root owns these files) right after start.
_TRUST_CA = f"""set -e
if command -v update-ca-certificates >/dev/null 2>&1; then
  update-ca-certificates >/dev/null 2>&1 || update-ca-certificates
else
  mkdir -p /etc/ssl/certs
  cat {CA_FILE} >> {CA_BUNDLE}
fi
grep -qF "$1" {CA_BUNDLE}
"""


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True, kw_only=True)
class SandboxSpec:
    identity: str
    proxy_url: str  # e.g. "http://172.30.99.1:8080": the gateway of the sandbox network
    ca_pem: str  # the Sandgate CA (`sandgate ca`), trusted system-wide in the sandbox
    token: str | None = None  # proxy token: goes into the proxy URL as identity:token
    image: str = DEFAULT_IMAGE
    placeholders: Mapping[str, str] = field(default_factory=dict)  # env, e.g. API key stand-ins
    memory: str = "512m"
    cpus: float = 1.0
    pids_limit: int = 256
    network: str = NETWORK_NAME
    labels: Mapping[str, str] = field(default_factory=dict)
    sandbox_id: str | None = None  # generated when None
    workdir: str = "/workspace"
    # The host firewall of the network lets sandboxes reach only the proxy (the port of
    # proxy_url, at the gateway). True opens every port of the gateway address: UNSAFE, every
    # service listening on the host then answers the sandboxes (of this whole network).
    allow_host_services: bool = False
    # Pattern 1 with the split (docs/pattern1.md; the image: sandgate-agent:dev): the agent and
    # its bash tool run as two users whose traffic reaches Sandgate's agent / tool listeners.
    split: SplitPorts | None = None
    # Transparent capture (sandgate.capture.nftables, `sandgate sandbox network --transparent`):
    # no proxy variable at all; the network's nftables rules take the sandbox's traffic to
    # Sandgate, which identifies it by its address (Docker labels). The CA is trusted as ever.
    transparent: bool = False
    extra_hosts: Mapping[str, str] = field(default_factory=dict)  # /etc/hosts: name -> address
    # The policy DNS's address (`sandgate run --dns ADDR:53`, docs/dns.md): the container's
    # resolver (Docker's own forwards to it). None: Docker's default resolvers.
    dns: str | None = None
    # Read-only bind mounts, host path -> container path (`--cli-dir`: the agents' pinned CLIs).
    mounts: Mapping[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if not _NAME.match(self.identity):
            raise SandboxError(f"invalid identity {self.identity!r}")
        if self.sandbox_id is not None and not _NAME.match(self.sandbox_id):
            raise SandboxError(f"invalid sandbox id {self.sandbox_id!r}")
        url = urlsplit(self.proxy_url)
        if url.scheme not in ("http", "https") or not url.hostname or url.username:
            raise SandboxError(
                f"proxy_url must be http(s)://HOST:PORT without credentials, got {self.proxy_url!r}"
            )
        if "-----BEGIN CERTIFICATE-----" not in self.ca_pem:
            raise SandboxError("ca_pem is not a PEM certificate (use the output of `sandgate ca`)")
        if "PRIVATE KEY" in self.ca_pem:
            raise SandboxError("ca_pem contains a private key: pass only the CA certificate")
        for name in self.placeholders:
            if not _ENV_NAME.match(name) or name in _RESERVED_ENV:
                raise SandboxError(f"placeholder name {name!r} is not a usable environment name")
        for key in self.labels:
            if key.startswith("sandgate."):
                raise SandboxError(f"label {key!r}: the sandgate.* labels are set by the launcher")
        if self.dns is not None:
            try:
                ipaddress.ip_address(self.dns)
            except ValueError:
                raise SandboxError(f"dns must be the policy DNS's IP address (Docker asks it "
                                   f"on port 53), got {self.dns!r}") from None
        for host, inside in self.mounts.items():
            if not host.startswith("/") or not inside.startswith("/") or ":" in host + inside:
                raise SandboxError(f"mount {host!r} -> {inside!r}: both must be absolute "
                                   "paths without ':'")
        if self.cpus <= 0 or self.pids_limit <= 0:
            raise SandboxError("cpus and pids_limit must be positive")
        if self.split is not None:
            self.split.validate(url.port or (443 if url.scheme == "https" else 80))

    def proxy_url_with_token(self) -> str:
        return proxy_url_with_credentials(self.proxy_url, self.identity, self.token)


def sandbox_environment(spec: SandboxSpec, sandbox_id: str) -> dict[str, str]:
    """Everything a sandbox's processes see: proxy, CA locations, placeholders. No secret."""
    env: dict[str, str] = dict(spec.placeholders)
    if spec.transparent:
        env.update(ca_environment(ca_bundle=CA_BUNDLE, ca_file=CA_FILE))
    else:
        env.update(proxy_environment(spec.proxy_url_with_token(), ca_bundle=CA_BUNDLE,
                                     ca_file=CA_FILE))
    env["SANDGATE_IDENTITY"] = spec.identity
    env["SANDGATE_SANDBOX"] = sandbox_id
    if spec.split is not None:
        env.update(spec.split.environment())
    return env


def _ca_archive(ca_pem: str) -> bytes:
    data = ca_pem.strip().encode() + b"\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        parts = CA_DIR.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            d = tarfile.TarInfo("/".join(parts[:i]))
            d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            tar.addfile(d)
        info = tarfile.TarInfo(CA_FILE.lstrip("/"))
        info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _shutdown(sock: Any) -> None:
    raw = getattr(sock, "_sock", sock)
    try:
        raw.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    # the HTTP response docker-py keeps on the socket: closed first, through its buffered
    # reader, or its finalizer later flushes a closed file ("Exception ignored ... I/O
    # operation on closed file" on the CLI's stderr)
    response = getattr(sock, "_response", None)
    if response is not None:
        try:
            response.close()
        except (OSError, ValueError):
            pass
    try:
        sock.close()
    except OSError:
        pass


def _lock_host(client: docker.DockerClient, spec: SandboxSpec) -> bool:
    """Put the network's host firewall in place for this spec: the host accepts the sandboxes'
    packets only at the proxy port of the gateway (none at all when proxy_url names another
    address, e.g. a proxy container), unless spec.allow_host_services; for a split sandbox also
    at its role listener ports, which stay open while split sandboxes run on the network.
    Whether it is in place."""
    info = inspect_network(client, spec.network)
    url = urlsplit(spec.proxy_url)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    on_host = literal is None or str(literal) in (info.gateway, info.gateway6)
    ports = {port}
    if spec.split is not None:  # its role listeners
        ports |= {spec.split.tool_port, spec.split.other_port}
    if on_host:  # and those of the split sandboxes already running there stay open
        ports |= _split_ports(client, spec.network)
    return restrict_host_access(client, info, sorted(ports) if on_host else [],
                                allow_host_services=spec.allow_host_services)


def _split_ports(client: docker.DockerClient, network: str) -> set[int]:
    """The role listener ports of the split sandboxes running on the network: a sandbox started
    later must not close the host firewall on them."""
    ports: set[int] = set()
    for c in client.containers.list(filters={"label": f"{LABEL_SPLIT}=uid",
                                             "network": network}):
        env = dict(e.partition("=")[::2] for e in c.attrs["Config"].get("Env") or [])
        for name in ("SANDGATE_SPLIT_TOOL_PORT", "SANDGATE_SPLIT_OTHER_PORT"):
            if env.get(name, "").isdigit():
                ports.add(int(env[name]))
    return ports


def _ca_fingerprint_line(ca_pem: str) -> str:
    """A line of the CA's base64 body, to check it made it into the bundle."""
    lines = [ln.strip() for ln in ca_pem.strip().splitlines()]
    body = [ln for ln in lines if ln and not ln.startswith("-----")]
    if not body:
        raise SandboxError("ca_pem has no certificate body")
    return max(body[:-1] or body, key=len)


class Sandbox:
    """A running sandbox container. Stateful: files persist between exec calls."""

    def __init__(self, client: docker.DockerClient, container: Container, spec: SandboxSpec,
                 sandbox_id: str) -> None:
        self.client = client
        self.container = container
        self.spec = spec
        self.id = sandbox_id
        self.identity = spec.identity
        self.host_firewall = False  # whether the network's host firewall is in place
        self.split_state: dict[str, Any] | None = None  # what a split sandbox's entrypoint set
        self._closed = False

    def _wait_split(self) -> dict[str, Any]:
        def read_state() -> str | None:
            res = self.exec(["cat", STATE_FILE], timeout=10, workdir="/", user="root")
            return res.stdout if res.ok else None

        def status() -> str:
            self.container.reload()
            return str(self.container.status)

        return wait_ready(read_state, status,
                          lambda: self.container.logs().decode("utf-8", "replace"))

    @property
    def name(self) -> str:
        return str(self.container.name)

    @property
    def ip(self) -> str:
        """The sandbox's address on its network (what the proxy sees as the client address)."""
        nets = self.container.attrs["NetworkSettings"]["Networks"]
        return str(nets[self.spec.network]["IPAddress"])

    @classmethod
    def create(cls, client: docker.DockerClient, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox. Raises SandboxError / DockerUnavailable; never leaves one running."""
        spec.validate()
        sandbox_id = spec.sandbox_id or f"sbx-{secrets.token_hex(6)}"
        try:
            return cls._create(client, spec, sandbox_id)
        except requests.ConnectionError as exc:
            raise unavailable(exc, client) from exc

    @classmethod
    def _create(cls, client: docker.DockerClient, spec: SandboxSpec, sandbox_id: str) -> Sandbox:
        try:
            client.images.get(spec.image)
        except ImageNotFound:
            raise SandboxError(
                f"image '{spec.image}' not found; build it with sandbox_images/build.sh"
            ) from None
        try:
            net = client.api.inspect_network(spec.network)
        except NotFound:
            raise SandboxError(
                f"network '{spec.network}' not found; create it with "
                "sandgate.sandbox.network.ensure_network()"
            ) from None
        if not net.get("Internal"):
            raise SandboxError(f"network '{spec.network}' is not internal: refusing to use it")
        firewall = _lock_host(client, spec)

        labels = {
            **spec.labels,
            LABEL_IDENTITY: spec.identity,
            LABEL_SANDBOX: sandbox_id,
            LABEL_MANAGED: "launcher",
            LABEL_SPLIT: "uid" if spec.split is not None else "none",
        }
        split_options = container_options() if spec.split is not None else {}
        try:
            container = client.containers.create(
                spec.image,
                command=["sleep", "infinity"],
                name=f"sandgate-{sandbox_id}",
                hostname=sandbox_id,
                labels=labels,
                environment=sandbox_environment(spec, sandbox_id),
                network=spec.network,  # this network only: no default bridge
                extra_hosts=dict(spec.extra_hosts) or None,
                dns=[spec.dns] if spec.dns is not None else None,  # the policy DNS only
                volumes={h: {"bind": c, "mode": "ro"} for h, c in spec.mounts.items()} or None,
                working_dir=spec.workdir,
                init=True,  # reap what exec'd commands leave behind
                cap_drop=["ALL"],
                **split_options,
                security_opt=["no-new-privileges:true"],
                mem_limit=spec.memory,
                memswap_limit=spec.memory,  # no swap beyond the memory limit
                nano_cpus=int(spec.cpus * 1e9),
                pids_limit=spec.pids_limit,
                detach=True,
            )
        except APIError as exc:
            raise SandboxError(f"cannot create sandbox from '{spec.image}': {exc}") from exc

        sandbox = cls(client, container, spec, sandbox_id)
        sandbox.host_firewall = firewall
        try:
            if spec.split is not None:  # the entrypoint trusts the CA, before the agent runs
                if not container.put_archive("/", _ca_archive(spec.ca_pem)):
                    raise SandboxError("could not write the Sandgate CA into the sandbox")
                container.start()
                sandbox.split_state = sandbox._wait_split()
            else:
                container.start()
                if not container.put_archive("/", _ca_archive(spec.ca_pem)):
                    raise SandboxError("could not write the Sandgate CA into the sandbox")
                res = sandbox.exec(
                    ["sh", "-c", _TRUST_CA, "trust-ca", _ca_fingerprint_line(spec.ca_pem)],
                    timeout=60, workdir="/", user="root",
                )
                if res.exit_code != 0:
                    raise SandboxError(
                        f"could not install the Sandgate CA in '{spec.image}' "
                        f"(exit {res.exit_code}): {res.stderr.strip()[-500:]}"
                    )
            container.reload()
            nets = set(container.attrs["NetworkSettings"]["Networks"])
            if nets != {spec.network}:
                raise SandboxError(f"sandbox attached to {sorted(nets)}, not only {spec.network}")
            if container.status != "running":
                raise SandboxError(f"sandbox exited right after start ({container.status})")
        except BaseException as exc:
            sandbox.close()
            if isinstance(exc, APIError):
                raise SandboxError(f"cannot start sandbox from '{spec.image}': {exc}") from exc
            raise
        log.info("sandbox %s (%s) started: identity %s, %s on %s",
                 sandbox_id, spec.image, spec.identity, sandbox.ip, spec.network)
        return sandbox

    def exec(
        self,
        cmd: str | Sequence[str],
        timeout: float = 120,
        workdir: str = "/workspace",
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        on_start: Callable[[str], None] | None = None,
    ) -> ExecResult:
        """Run a command (a string runs with `bash -c`) and wait for it, up to `timeout` seconds.

        On timeout the command's process group is killed (coreutils `timeout`) and the result
        has timed_out=True (exit code 124, or 137 when it needed SIGKILL). Processes that left
        that group (setsid, nested `timeout`) and keep the output open are abandoned 10 s later
        (timed_out=True; exit_code is the command's own, or -1 while it still runs); close()
        ends them.

        `on_start(exec_id)` runs once the command has started, while its output is read (the
        agent launcher registers the command's process there). What it raises ends the wait.
        """
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise SandboxError("empty command")
        if self.spec.split is not None and user is None:  # the agent, with no capability
            argv, user = [*AS_AGENT, *argv], "root"
        secs = max(1, int(timeout + 0.999))
        wrapped = ["timeout", "--kill-after=5", str(secs), *argv]
        api = self.client.api
        started = time.monotonic()
        out, err = bytearray(), bytearray()
        dropped = [0, 0]
        try:
            exec_id = api.exec_create(
                self.container.id, wrapped, stdout=True, stderr=True, stdin=False, tty=False,
                workdir=workdir, user=user or "", environment=dict(env) if env else None,
            )["Id"]
            sock = api.exec_start(exec_id, socket=True)

            def pump() -> None:
                try:
                    for stream_id, chunk in frames_iter(sock, tty=False):
                        i = 1 if stream_id == STDERR else 0
                        buf = err if i else out
                        room = max(_OUTPUT_LIMIT - len(buf), 0)
                        buf += chunk[:room]
                        dropped[i] += max(len(chunk) - room, 0)
                except (OSError, ValueError):
                    pass  # the socket was shut down by the backstop below

            reader = threading.Thread(target=pump, name=f"sandbox-exec-{self.id}", daemon=True)
            reader.start()
            if on_start is not None:
                try:
                    on_start(exec_id)
                except BaseException:
                    _shutdown(sock)
                    raise
            # Backstop: something that escaped `timeout` (its own session, a daemon holding
            # stdout) must not block the caller forever. It is left to close().
            reader.join(secs + _EXEC_GRACE)
            backstop = reader.is_alive()
            if backstop:
                _shutdown(sock)
                reader.join(2)
            else:
                _shutdown(sock)
            info = api.exec_inspect(exec_id)
        except requests.ConnectionError as exc:
            raise unavailable(exc, self.client) from exc
        except APIError as exc:
            raise SandboxError(f"exec in sandbox {self.id} failed: {exc}") from exc
        duration = time.monotonic() - started
        code = info.get("ExitCode")
        exit_code = -1 if code is None or info.get("Running") else int(code)
        timed_out = backstop or (exit_code in (124, 137) and duration >= secs - 0.5)
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        if dropped[0]:
            stdout += f"\n[sandgate: {dropped[0]} more bytes of output dropped]"
        if dropped[1]:
            stderr += f"\n[sandgate: {dropped[1]} more bytes of output dropped]"
        return ExecResult(exit_code, stdout, stderr, timed_out, duration)

    def close(self) -> None:
        """Stop and remove the container (and its anonymous volumes). Idempotent."""
        if self._closed:
            return
        try:
            self.container.remove(force=True, v=True)
        except NotFound:
            pass
        except APIError as exc:
            if exc.status_code != 409:  # 409: removal already in progress
                raise SandboxError(f"could not remove sandbox {self.id}: {exc}") from exc
        except requests.ConnectionError as exc:
            raise unavailable(exc, self.client) from exc
        self._closed = True
        log.info("sandbox %s removed", self.id)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, identity={self.identity!r}, image={self.spec.image!r})"


def run_once(
    client: docker.DockerClient, spec: SandboxSpec, cmd: str | Sequence[str],
    timeout: float = 120, **exec_kwargs: Any,
) -> ExecResult:
    """Create a sandbox, run one command, remove it (also when anything fails)."""
    with Sandbox.create(client, spec) as sandbox:
        return sandbox.exec(cmd, timeout=timeout, **exec_kwargs)


def list_sandboxes(client: docker.DockerClient, include_stopped: bool = True) -> list[Container]:
    """Containers this launcher created (running and, by default, stopped ones)."""
    return list(
        client.containers.list(
            all=include_stopped, filters={"label": f"{LABEL_MANAGED}=launcher"}
        )
    )
