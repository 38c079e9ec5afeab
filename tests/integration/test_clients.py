"""Real clients that are strict about framing and TLS shutdown, through the real proxy."""

from __future__ import annotations

import hashlib
import http.server
import os
import ssl
import subprocess
import threading
from collections.abc import Iterator

import pytest

from tests.integration.conftest import OLD_SERVER_IP, curl, split_status

pytestmark = pytest.mark.integration

SMALL = b"small body, no secret here\n" * 10
LARGE = os.urandom(3 * 1024 * 1024)  # over the whole-body limit: streamed, reframed


class _Old(http.server.BaseHTTPRequestHandler):
    """HTTP/1.0 like many small embedded servers: a Content-Length, then the connection closes."""

    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        body = LARGE if self.path == "/large" else SMALL
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def old_server(pki) -> Iterator[None]:
    server = http.server.ThreadingHTTPServer((OLD_SERVER_IP, 443), _Old)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(pki.cert), str(pki.key))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("path,body", [("/small", SMALL), ("/large", LARGE)], ids=["small",
                                                                                 "large"])
def test_wget_through_sandgate_with_a_secret_cached(proxy, old_server, tmp_path, path, body):
    """wget (GnuTLS) from an HTTP/1.0 upstream: it failed with "The TLS connection was
    non-properly terminated" once any secret was cached (the body became close-delimited)."""
    r = curl(proxy, "coding-agent", "https://api.anthropic.com/v1/messages", "-d", "{}")
    assert split_status(r.stdout)[1] == 200  # a secret is cached: responses are scrubbed now
    out = tmp_path / "out"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "https_proxy": f"http://coding-agent:{proxy.token('coding-agent')}@"
                          f"{proxy.host}:{proxy.port}/"}
    w = subprocess.run(["wget", "-q", "--tries=1", "--timeout=20",
                        f"--ca-certificate={proxy.ca}", "-O", str(out),
                        f"https://old.test{path}"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert w.returncode == 0, w.stderr[-2000:]
    got = out.read_bytes()
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(body).hexdigest()
