"""A real nginx (Debian's package) serving several TLS virtual hosts on one loopback address.

Each virtual host writes its own access log, one line per request, `$host|$request`, so a test
can tell which vhost a request reached and in which form its request line arrived. The whole
configuration lives in a temporary directory; nginx runs in the foreground as a child of the
test and is stopped with bounded waits.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

_CONF = """\
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
daemon off;
worker_processes 1;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    log_format r2 '$host|$request';
    ssl_certificate {cert};
    ssl_certificate_key {key};
{servers}
}}
"""

_SERVER = """\
    server {{
        listen {ip}:{port} ssl{default};
        server_name {name};
        access_log {log} r2;
        default_type text/plain;
        location / {{ return 200 "vhost {name}\\n"; }}
    }}
"""


def available() -> bool:
    return shutil.which("nginx") is not None or Path("/usr/sbin/nginx").exists()


class Nginx:
    def __init__(self, directory: Path, ip: str, port: int, names: list[str], cert: Path,
                 key: Path) -> None:
        self.dir, self.ip, self.port, self.names = directory, ip, port, names
        self.cert, self.key = cert, key
        self.proc: subprocess.Popen[bytes] | None = None

    def log_path(self, name: str) -> Path:
        return self.dir / f"access-{name}.log"

    def requests(self, name: str) -> list[str]:
        """`$host|$request` lines the vhost `name` logged (nginx writes them unbuffered)."""
        p = self.log_path(name)
        return p.read_text().splitlines() if p.exists() else []

    def start(self) -> Nginx:
        self.dir.mkdir(parents=True, exist_ok=True)
        servers = "".join(
            _SERVER.format(ip=self.ip, port=self.port, name=n, log=self.log_path(n),
                           default=" default_server" if i == 0 else "")
            for i, n in enumerate(self.names))
        conf = self.dir / "nginx.conf"
        conf.write_text(_CONF.format(dir=self.dir, cert=self.cert, key=self.key,
                                     servers=servers))
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        test = subprocess.run([binary, "-t", "-p", str(self.dir), "-c", str(conf)],
                              capture_output=True, text=True, timeout=15)
        if test.returncode != 0:
            raise RuntimeError(f"nginx -t failed: {test.stderr}")
        self.proc = subprocess.Popen([binary, "-p", str(self.dir), "-c", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"nginx exited {self.proc.returncode}: {err}")
            try:
                with socket.create_connection((self.ip, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("nginx did not listen within 10 s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)  # graceful: finish, then exit
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
