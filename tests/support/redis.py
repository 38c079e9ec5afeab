"""A real `redis-server` (Debian's package) for tests: its own temp dir, no persistence.

On a unix socket (unit tests: no TCP port in the host namespace) or on a fixed loopback address
(integration tests, inside their own network namespace). `kill()` is SIGKILL (a crash);
`start()` again brings it back on the same address, empty.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


class RedisServer:
    def __init__(self, directory: Path, host: str | None = None, port: int = 6379,
                 password: str | None = None,
                 tls: tuple[Path, Path, Path] | None = None) -> None:
        self.dir = directory
        self.host = host
        self.port = port
        self.password = password
        self.tls = tls  # (cert, key, CA): TLS only on `port`
        self.socket = directory / "redis.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        assert self.host is not None, "a unix-socket server has no redis:// URL"
        return f"{'rediss' if self.tls else 'redis'}://{auth}{self.host}:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh --test)")
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = ["--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--logfile", str(self.dir / "redis.log")]
        if self.host is None:
            conf += ["--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        elif self.tls is not None:
            cert, key, ca = self.tls
            conf += ["--bind", self.host, "--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                     "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
        else:
            conf += ["--bind", self.host, "--port", str(self.port)]
        if self.password:
            conf += ["--requirepass", self.password]
        self.proc = subprocess.Popen([exe, *conf], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("redis-server exited:\n" + self.log()[-2000:])
            if self._answers():
                return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not come up:\n" + self.log()[-2000:])

    def _answers(self) -> bool:
        try:
            if self.host is None:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(0.5)
                    s.connect(str(self.socket))
            else:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
        except OSError:
            return False
        return True

    def log(self) -> str:
        p = self.dir / "redis.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.socket.unlink(missing_ok=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.socket.unlink(missing_ok=True)
