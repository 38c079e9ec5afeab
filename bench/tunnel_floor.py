"""The floor of a CONNECT tunnel in Python: what a lean passthrough path could cost at best.

    python bench/tunnel_floor.py HOST PORT
    python bench/tunnel_floor.py HOST PORT --sandgate CONFDIR POLICIES AUDIT NAME=IP...

Not Sandgate: a bare asyncio CONNECT proxy doing the least a passthrough path must do (read a
bounded head, parse it with mitmproxy's own parser, compute an HMAC over the Proxy-Authorization
value as a token check would, dial, answer 200, relay through protocol callbacks, write one
JSON line per tunnel) and nothing else: no policy, no ClientHello check, no limits, no metrics.
`bench/focus.py --only squid,tunnel-floor,tunnel-floor-judged,sandgate-passthrough --phase
new_conn` compares its CPU per new tunnel with squid's and Sandgate's: if even the judged floor
is at twice squid's, no passthrough path built on that loop reaches that target
(docs/performance.md, issue 29).

With `--sandgate` (the `tunnel-floor-judged` variant) it does Sandgate's own per-tunnel work
instead, with Sandgate's own functions, in the least code: the proxy token checked
(`tokens.authenticate_basic` with the confdir's key), the CONNECT judged (`decide_connect` over
the policy directory) and its address (`judge_address` over the --resolve pins), the
ClientHello read and parsed (mitmproxy's parser) and its SNI compared with the CONNECT host,
and the `connect` event written through a chained `AuditLog` with the confdir's signing key.
Still no limits, no metrics, no admission, no timeouts: a floor.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mitmproxy.net.http.http1 import read_request_head
from mitmproxy.proxy.layers.tls import parse_client_hello

from sandgate import confdir as cd
from sandgate import decision, tokens
from sandgate.audit import chain as audit_chain
from sandgate.audit.events import AuditLog
from sandgate.policy.loader import load_policy_dir

KEY = os.urandom(32)
MAX_HEAD = 8192


class Upstream(asyncio.Protocol):
    def __init__(self, peer: Client) -> None:
        self.peer = peer
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.peer.transport.write(data)

    def eof_received(self) -> bool:
        self.peer.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.peer.transport.close()


class Judged:
    """Sandgate's per-tunnel work, by Sandgate's functions."""

    def __init__(self, confdir: str, policies: str, audit: str, pins: list[str]) -> None:
        self.key = cd.token_key(Path(confdir))
        self.policy = load_policy_dir(policies)
        self.pins = dict(p.split("=", 1) for p in pins)
        # the proxy's defaults: a signed checkpoint every 1,000 lines or 60 s
        chain = audit_chain.Chain(audit_chain.confdir_signing_key(Path(confdir)),
                                  audit_chain.DEFAULT_CHECKPOINT_LINES,
                                  audit_chain.DEFAULT_CHECKPOINT_SECONDS)
        self.log = AuditLog(audit, chain=chain)

    def connect(self, req: Any) -> tuple[bool, str]:
        caller = tokens.authenticate_basic(req.headers.get("proxy-authorization"), self.key)
        d = decision.decide_connect(self.policy, caller.identity, req.host, req.port)
        d, _why = decision.judge_address(d, req.host, req.port, self.pins)
        if not (d.allowed and d.tunnel):
            return False, ""
        self.log.emit("connect", identity=caller.identity, sandbox=caller.sandbox,
                      host=req.host, port=req.port, action="allow",
                      rule=d.rule.name if d.rule else None, reason=d.reason)
        return True, self.pins.get(req.host, req.host)


class Client(asyncio.Protocol):
    def __init__(self, audit: Any, judged: Judged | None = None) -> None:
        self.audit = audit
        self.judged = judged
        self.buf = b""
        self.up: Upstream | None = None
        self.transport: Any = None
        # judged: the ClientHello so far, until its SNI is checked (None: checked, or bare)
        self.hello: bytes | None = b"" if judged is not None else None
        self.host = ""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.up is not None and self.up.transport is not None:
            if self.hello is not None:
                self.hello += data
                if not self.check_hello(self.hello):
                    return
                data, self.hello = self.hello, None
            self.up.transport.write(data)
            return
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD:
                self.transport.close()
            return
        head, rest = self.buf[:end + 4], self.buf[end + 4:]
        req = read_request_head(head.split(b"\r\n")[:-2])
        if self.judged is not None:
            try:
                ok, ip = self.judged.connect(req)
            except Exception:  # sandgate.errors.IdentityError (no or a bad token), ...
                ok, ip = False, ""
            if not ok:
                self.transport.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
                self.transport.close()
                return
            self.host = req.host
            self.transport.pause_reading()
            asyncio.get_running_loop().create_task(self.dial(ip, req.port, rest))
            return
        token = req.headers.get("proxy-authorization", "")
        mac = hmac.new(KEY, token.encode(), hashlib.sha256).digest()
        # what checking a token costs; the check passes (the bench client sends squid no token
        # either)
        if req.method != "CONNECT" or not hmac.compare_digest(mac, mac):
            self.transport.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()
            return
        self.transport.pause_reading()
        asyncio.get_running_loop().create_task(self.dial(req.host, req.port, rest))

    async def dial(self, host: str, port: int, rest: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _t, up = await loop.create_connection(lambda: Upstream(self), host, port)
        except OSError:
            self.transport.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()
            return
        self.up = up
        if self.judged is None:  # judged: the chained AuditLog wrote the line
            self.audit.write(json.dumps({"time": time.time(), "event": "connect", "host": host,
                                         "port": port, "action": "allow"}) + "\n")
        self.transport.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if rest:
            up.transport.write(rest)
        self.transport.resume_reading()

    def check_hello(self, raw: bytes) -> bool:
        """The whole ClientHello is here and its SNI is the CONNECT host (else: not yet, or
        closed)."""
        try:
            hello = parse_client_hello(raw)
        except ValueError:
            self.transport.close()
            return False
        if hello is None:
            return False
        if (hello.sni or "").lower() != self.host.lower():
            self.transport.close()
            return False
        return True

    def eof_received(self) -> bool:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()


async def main(host: str, port: int, judged: Judged | None) -> None:
    audit = open(os.devnull, "w")
    server = await asyncio.get_running_loop().create_server(lambda: Client(audit, judged),
                                                            host, port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    j = (Judged(sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7:])
         if sys.argv[3:4] == ["--sandgate"] else None)
    if os.environ.get("FLOOR_UVLOOP"):  # the same floor on uvloop's loop (if installed)
        import uvloop

        uvloop.run(main(sys.argv[1], int(sys.argv[2]), j))
    else:
        asyncio.run(main(sys.argv[1], int(sys.argv[2]), j))
