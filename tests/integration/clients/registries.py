"""Real local package servers for the client matrix, all behind one TLS listener on the host.

One ThreadingHTTPServer (HTTP/1.1, TLS) answers for several names, told apart by Host:

- ``pypi.clients.test``: a PEP 503 simple index (``/simple/sgdemo/``) and the wheel it links
  (a real wheel built here), for pip, uv, requests, httpx, aiohttp and urllib;
- ``npm.clients.test``: an npm registry as npm reads one: the packument (``/sgdemo``) and the
  tarball it names, with sha1 ``shasum`` and sha512 ``integrity`` (a static registry, not
  verdaccio: npm install speaks the same two requests to either);
- ``go.clients.test``: a GOPROXY tree (``@v/list``, ``.info``, ``.mod``, ``.zip``);
- ``crates.clients.test``: a cargo sparse registry (``config.json``, the index file, the
  ``.crate`` download);
- ``git.clients.test``: git smart HTTP by ``git http-backend`` (CGI), Basic auth required;
- ``files.clients.test``: plain files, for curl and wget.

Every request is recorded (host, method, path, Authorization) for the tests' assertions.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.server
import io
import json
import os
import shutil
import ssl
import subprocess
import tarfile
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.pki import Pki

DOMAIN = "clients.test"
HOSTS = ("pypi", "npm", "go", "crates", "git", "files", "forbidden")
NAMES = [f"{h}.{DOMAIN}" for h in HOSTS]
GIT_USER = "sandgate-git"
FILE_BODY = b"hello from the clients matrix\n"
GO_MODULE = f"{DOMAIN}/sgmod"


@dataclass
class Seen:
    host: str
    method: str
    path: str
    authorization: str | None


@dataclass
class Registries:
    root: Path
    git_password: str
    pki: Pki  # the upstream CA (Sandgate's --upstream-ca) and the servers' certificate
    seen: list[Seen] = field(default_factory=list)
    files: dict[tuple[str, str], tuple[bytes, str]] = field(default_factory=dict)

    # --- content -----------------------------------------------------------------------------
    def build(self) -> None:
        self._pypi()
        self._npm()
        self._go()
        self._crates()
        self._git()
        self.add("files", "/hello.txt", FILE_BODY, "text/plain")

    def add(self, host: str, path: str, body: bytes, ctype: str = "application/octet-stream"
            ) -> None:
        self.files[(f"{host}.{DOMAIN}", path)] = (body, ctype)

    def _pypi(self) -> None:
        name, version = "sgdemo", "1.0"
        dist = f"{name}-{version}"
        wheel_name = f"{dist}-py3-none-any.whl"
        members = {
            f"{name}.py": b"MESSAGE = 'sgdemo imported'\n",
            f"{dist}.dist-info/METADATA":
                f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
            f"{dist}.dist-info/WHEEL":
                b"Wheel-Version: 1.0\nGenerator: sandgate-tests\nRoot-Is-Purelib: true\n"
                b"Tag: py3-none-any\n",
        }
        record = "".join(
            f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
            f"{len(d)}\n" for p, d in members.items()
        ) + f"{dist}.dist-info/RECORD,,\n"
        members[f"{dist}.dist-info/RECORD"] = record.encode()
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for p, d in members.items():
                z.writestr(p, d)
        wheel = buf.getvalue()
        digest = hashlib.sha256(wheel).hexdigest()
        self.add("pypi", f"/files/{wheel_name}", wheel)
        page = (f'<!DOCTYPE html><html><body><a href="/files/{wheel_name}#sha256={digest}">'
                f"{wheel_name}</a></body></html>\n").encode()
        self.add("pypi", f"/simple/{name}/", page, "text/html")
        self.add("pypi", "/simple/", f'<a href="/simple/{name}/">{name}</a>\n'.encode(),
                 "text/html")

    def _npm(self) -> None:
        name, version = "sgdemo", "1.0.0"
        pkg = {"name": name, "version": version, "main": "index.js"}
        tgz = _targz({"package/package.json": json.dumps(pkg).encode(),
                      "package/index.js": b"module.exports = 'sgdemo required';\n"})
        tarball = f"https://npm.{DOMAIN}/{name}/-/{name}-{version}.tgz"
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode()
        packument = {
            "name": name, "dist-tags": {"latest": version},
            "versions": {version: {**pkg, "dist": {
                "tarball": tarball, "shasum": hashlib.sha1(tgz).hexdigest(),
                "integrity": integrity}}},
        }
        self.add("npm", f"/{name}", json.dumps(packument).encode(), "application/json")
        self.add("npm", f"/{name}/-/{name}-{version}.tgz", tgz)

    def _go(self) -> None:
        version = "v1.0.0"
        mod = f"module {GO_MODULE}\n\ngo 1.19\n".encode()
        buf = io.BytesIO()
        prefix = f"{GO_MODULE}@{version}/"
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr(prefix + "go.mod", mod)
            z.writestr(prefix + "sgmod.go", b"package sgmod\n\nconst Message = \"sgmod\"\n")
        base = f"/{GO_MODULE}/@v"
        self.add("go", f"{base}/list", f"{version}\n".encode(), "text/plain")
        self.add("go", f"{base}/{version}.info",
                 json.dumps({"Version": version, "Time": "2024-01-01T00:00:00Z"}).encode(),
                 "application/json")
        self.add("go", f"{base}/{version}.mod", mod, "text/plain")
        self.add("go", f"{base}/{version}.zip", buf.getvalue(), "application/zip")

    def _crates(self) -> None:
        name, version = "sgcrate", "1.0.0"
        toml = (f'[package]\nname = "{name}"\nversion = "{version}"\nedition = "2021"\n'
                ).encode()
        lib = b"pub const MESSAGE: &str = \"sgcrate\";\n"
        crate = _targz({f"{name}-{version}/Cargo.toml": toml,
                        f"{name}-{version}/src/lib.rs": lib})
        self.add("crates", "/index/config.json", json.dumps(
            {"dl": f"https://crates.{DOMAIN}/dl/{{crate}}/{{version}}/download"}).encode(),
            "application/json")
        line = {"name": name, "vers": version, "deps": [], "features": {}, "yanked": False,
                "cksum": hashlib.sha256(crate).hexdigest()}
        self.add("crates", f"/index/{name[:2]}/{name[2:4]}/{name}",
                 (json.dumps(line) + "\n").encode(), "text/plain")
        self.add("crates", f"/dl/{name}/{version}/download", crate)

    def _git(self) -> None:
        git_root = self.root / "git"
        work = self.root / "git-work"
        for repo in ("readonly.git", "pushable.git"):
            shutil.rmtree(git_root / repo, ignore_errors=True)
            _git("init", "-q", "--bare", "-b", "main", str(git_root / repo))
            _git("-C", str(git_root / repo), "config", "http.receivepack", "true")
        shutil.rmtree(work, ignore_errors=True)
        _git("init", "-q", "-b", "main", str(work))
        (work / "README").write_text("cloned through Sandgate\n")
        _git("-C", str(work), "add", "README")
        _git("-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
             "-m", "first")
        for repo in ("readonly.git", "pushable.git"):
            _git("-C", str(work), "push", "-q", str(git_root / repo), "main")

    # --- serving -----------------------------------------------------------------------------
    def serve(self, ip: str, port: int, cert: Path, key: Path) -> http.server.ThreadingHTTPServer:
        registries = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _host(self) -> str:
                return (self.headers.get("Host") or "").rsplit(":", 1)[0].lower()

            def _send(self, status: int, body: bytes, ctype: str = "text/plain",
                      extra: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                host = self._host()
                registries.seen.append(Seen(host, self.command, self.path,
                                            self.headers.get("Authorization")))
                body = self._body() if self.command == "POST" else b""
                if host == f"git.{DOMAIN}":
                    self._git(body)
                    return
                path = self.path.split("?", 1)[0]
                hit = registries.files.get((host, path))
                if hit is None:
                    self._send(404, b"not found\n")
                else:
                    self._send(200, hit[0], hit[1])

            def _git(self, body: bytes) -> None:
                want = "Basic " + base64.b64encode(
                    f"{GIT_USER}:{registries.git_password}".encode()).decode()
                if self.headers.get("Authorization") != want:
                    self._send(401, b"credentials required\n",
                               extra={"WWW-Authenticate": 'Basic realm="git"'})
                    return
                path, _, query = self.path.partition("?")
                env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(registries.root / "git"),
                       "GIT_HTTP_EXPORT_ALL": "1", "REQUEST_METHOD": self.command,
                       "PATH_INFO": path, "QUERY_STRING": query, "REMOTE_USER": GIT_USER,
                       "REMOTE_ADDR": "127.0.0.1", "CONTENT_LENGTH": str(len(body)),
                       "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                       "GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
                if self.headers.get("Content-Encoding"):
                    env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
                res = subprocess.run(["git", "http-backend"], input=body, env=env,
                                     capture_output=True, timeout=60)
                head, _, out = res.stdout.partition(b"\r\n\r\n")
                if not _:
                    head, _, out = res.stdout.partition(b"\n\n")
                status, headers = 200, {}
                for line in head.decode("latin-1").splitlines():
                    k, _, v = line.partition(":")
                    if k.lower() == "status":
                        status = int(v.strip().split()[0])
                    elif k.lower() not in ("content-length", "content-type"):
                        headers[k.strip()] = v.strip()
                    elif k.lower() == "content-type":
                        headers["_ctype"] = v.strip()
                ctype = headers.pop("_ctype", "application/octet-stream")
                self._send(status, out, ctype, headers)

            do_GET = do_HEAD = do_POST = _handle

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer((ip, port), Handler)
        server.daemon_threads = True
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(cert), str(key))
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def git_log(self, repo: str) -> str:
        return _git("-C", str(self.root / "git" / repo), "log", "--format=%s", "main")


def _targz(members: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1700000000
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout
