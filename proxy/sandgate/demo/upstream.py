"""The demo's stand-in for an LLM API: HTTPS on loopback, answering every POST with what it
received.

It answers with the SHA-256 fingerprint of the `x-api-key` it received (so the demo can show that
Sandgate injected the Vault value without printing it), and, when the request body asks for it
with `{"echo": true}`, reflects the key back in a response header and in the body, as a careless
or compromised API would: what the sandbox then receives shows Sandgate's scrubbing.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from sandgate.demo.pki import make_pki

REFLECT_HEADER = "x-echo-api-key"


def fingerprint(value: str) -> str:
    """What the demo prints instead of a key: the first 12 hex digits of its SHA-256."""
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:12]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        try:
            echo = bool(json.loads(body or b"{}").get("echo"))
        except (ValueError, AttributeError):
            echo = False
        key = self.headers.get("x-api-key") or ""
        answer: dict[str, object] = {
            "content": "hello from the demo's stand-in LLM API",
            "received_key": fingerprint(key) if key else None,
        }
        if echo:
            answer["echo"] = {"x-api-key": key}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        if echo:
            self.send_header(REFLECT_HEADER, key)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass  # the demo prints its own lines


class EchoUpstream:
    """The stand-in API on 127.0.0.1 (an ephemeral port), with a certificate for `name` from a
    throwaway CA whose PEM is `ca_cert` (Sandgate trusts it through --upstream-ca)."""

    def __init__(self, directory: Path, name: str) -> None:
        pki = make_pki(directory, [name], ca_common_name="sandgate demo upstream CA")
        self.ca_cert = pki.ca_cert
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki.cert, pki.key)
        ctx.set_alpn_protocols(["http/1.1"])
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="demo-upstream",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
