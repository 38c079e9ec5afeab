"""Faults: upstreams that reset, never answer, or fail TLS, while other clients keep calling."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from tests.integration.soak.conftest import (
    IDENTITIES,
    LISTEN,
    NAMES,
    SECRET_VALUES,
    finish,
    placeholder,
    start_soak_proxy,
)
from tests.integration.soak.mix import Case, check, client_ssl, leaked, make_case, run_worker
from tests.support.hangup import HangUp
from tests.support.loadclient import Req, Tunnel
from tests.support.pki import make_pki
from tests.support.rawupstream import RawServer

pytestmark = pytest.mark.soak


@pytest.fixture
def broken_tls(soak_pki, tmp_path) -> Iterator[dict[str, RawServer]]:
    stranger = make_pki(tmp_path / "stranger", NAMES)  # right names, a CA nobody trusts
    servers = {
        "wrong.other.test": RawServer("127.0.12.4", 443, str(soak_pki.cert), str(soak_pki.key)),
        "untrusted.soak.test": RawServer("127.0.12.5", 443, str(stranger.cert),
                                         str(stranger.key)),
        "plaintls.soak.test": RawServer("127.0.12.6", 443),  # speaks plain HTTP on 443
    }
    for s in servers.values():
        s.start()
    hang = HangUp("127.0.12.7")
    try:
        yield servers
    finally:
        hang.close()
        for s in servers.values():
            s.stop()


async def fetch_raw(port: int, token: str, identity: str, host: str, req: Req, ctx,
                    timeout: float) -> tuple[bytes, str]:
    """Send one request on a fresh tunnel; everything received until the proxy closes.

    Returns (bytes, how it ended: "eof", "reset" or "timeout")."""
    t = Tunnel(LISTEN, port, identity, token, host, ssl_ctx=ctx, timeout=timeout)
    await t._open()
    assert t._r is not None and t._w is not None
    lines = [f"{req.method} {req.path} HTTP/1.1", f"Host: {host}", f"X-Soak-Id: {req.rid}",
             *(f"{k}: {v}" for k, v in req.headers), f"Content-Length: {len(req.body)}",
             "Connection: close"]
    t._w.write(("\r\n".join(lines) + "\r\n\r\n").encode() + req.body)
    got = bytearray()
    ended = "eof"
    try:
        async with asyncio.timeout(timeout):
            while chunk := await t._r.read(65536):
                got += chunk
    except TimeoutError:
        ended = "timeout"
    except (ConnectionError, OSError):
        ended = "reset"
    finally:
        t.close()
    return bytes(got), ended


def looks_complete(raw: bytes) -> bool:
    """Would a client take this cut answer for a whole one? (its framing says it ended)"""
    head, _, body = raw.partition(b"\r\n\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in
              (ln.partition(b":") for ln in head.split(b"\r\n")[1:])}
    if b"content-length" in fields:
        return len(body) >= int(fields[b"content-length"])
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        return body.endswith(b"\r\n0\r\n\r\n") or body == b"0\r\n\r\n"
    return False  # read to EOF: a cut looks like an end, but there is no framing to trust


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


def test_upstream_faults_and_tls_failures(tmp_path, soak_vault, soak_pki, recorder,
                                          plain_recorder, broken_tls):
    """Bounds: 9 faults x 6 concurrent requests each (54 faulty requests, 10 s client limit
    each) alongside 8 clients x 60 normal requests; --upstream-connect-timeout 2 and
    --upstream-read-timeout 2; about 15 s.

    Upstream resets (before reading the body, before answering, half way through a 256 KiB
    body the proxy buffers, half way through a 4 MiB body it streams), upstreams that never
    answer (no response head; plain HTTP on 443 that never sends a ServerHello), and TLS
    failures (a certificate for other names, an untrusted CA, a reset right after accept):
    each gets exactly its answer, with the JSON refusal body and never a secret (the broken
    upstreams quote the credential): 502 upstream_error for a reset or a failed handshake,
    504 upstream_timeout (after the read timeout, well before the client's own limit) for
    silence, a cut connection (never a complete-looking answer) for a reset in a streamed
    body. No client waits until it gives up. Every faulty request has its request event in the
    audit; the upstreams that failed TLS never received a request; the proxy lets go of the
    silent upstream; and the normal clients get every answer right meanwhile.
    """
    sp = start_soak_proxy(tmp_path, soak_vault, soak_pki, "--upstream-connect-timeout", "2",
                          "--upstream-read-timeout", "2")
    ident = IDENTITIES[0]
    key = SECRET_VALUES[f"key_{ident[-1]}"]
    ph = [("x-api-key", placeholder(f"key_{ident[-1]}"))]
    big = b"x" * (256 * 1024)
    faults = {
        # name: (host, path, body, the one acceptable ending)
        "reset-early": ("api.soak.test", "/reset-early/", big, 502),
        "reset-head": ("api.soak.test", "/reset-head/", b"{}", 502),
        "reset-body": ("api.soak.test", "/reset-body/", b"{}", 502),  # buffered whole
        "reset-stream": ("api.soak.test", "/reset-stream/", b"{}", "cut"),  # streamed
        # silence: the read timeout (2 s) ends it, with a 504 the client can act on
        "silent": ("api.soak.test", "/silent/", b"{}", 504),
        "plain-on-443": ("plaintls.soak.test", "/v1/x", b"{}", 504),  # no ServerHello
        "wrong-name": ("wrong.other.test", "/v1/x", b"{}", 502),
        "untrusted": ("untrusted.soak.test", "/v1/x", b"{}", 502),
        "hangup": ("hangup.soak.test", "/v1/x", b"{}", 502),  # RST at accept
    }
    client_limit = 10

    async def scenario():
        ctx = client_ssl(str(sp.proxy.ca))
        port, token = sp.proxy.port, sp.tokens[ident]
        # warm: the key is cached, so the scrubber knows it before any fault quotes it
        warm = await run_worker(port, sp.tokens, ctx, [make_case("inject", ident, "ft-warm")])
        normal = [asyncio.create_task(run_worker(
            port, sp.tokens, ctx,
            [make_case(("inject", "bearer", "open", "no_rule")[n % 4], IDENTITIES[w % 4],
                       f"ft-{w}-{n}") for n in range(60)])) for w in range(8)]
        faulty = {name: [asyncio.create_task(fetch_raw(
            port, token, ident, host, Req(f"ft-{name}-{i}", "POST", f"{path}{i}", ph, body),
            ctx, client_limit)) for i in range(6)]
            for name, (host, path, body, _) in faults.items()}
        got = {name: await asyncio.gather(*tasks) for name, tasks in faulty.items()}
        done: list[tuple[Case, object]] = list(warm)
        for part in await asyncio.gather(*normal):
            done += part
        return got, done

    try:
        started = time.monotonic()
        got, normal = asyncio.run(scenario())
        print(f"\nfaults: {sum(len(v) for v in got.values())} faulty and {len(normal)} normal "
              f"requests in {time.monotonic() - started:.1f} s")
        problems = check(normal, {"https": recorder, "http": plain_recorder})
        assert not problems, "normal clients were hurt:\n" + "\n".join(problems[:20])
        for name, answers in got.items():
            want = faults[name][3]
            for i, (raw, ended) in enumerate(answers):
                assert not leaked(raw), f"{name}: a secret in the answer"
                assert ended != "timeout", \
                    f"{name} request {i}: the client gave up after {client_limit} s"
                status = status_of(raw)
                if want == "cut":
                    # streamed answer cut short: the client must see it incomplete
                    assert status in (0, 200), f"{name}: got {status}"
                    assert not looks_complete(raw), f"{name}: a complete-looking answer"
                    continue
                assert status == want, f"{name}: got {status} ({ended}), expected {want}"
                code = "upstream_error" if want == 502 else "upstream_timeout"
                head, _, body = raw.partition(b"\r\n\r\n")
                assert b"x-sandgate-reason: " + code.encode() in head.lower(), \
                    f"{name}: {head[:300]!r}"
                refusal = json.loads(body)
                assert (refusal["error"], refusal["code"], refusal["status"]) == (
                    "sandgate_refused", code, want), f"{name}: {refusal}"
        # TLS failed before any request: nothing reached those upstreams, no credential left
        for host, server in broken_tls.items():
            assert not server.requests, f"{host} received a request over failed TLS"
            assert not any(key.encode() in bytes(b) for b in server.raw), f"{host} got the key"
        # the proxy let go of the silent upstream (its read timeout ended the wait)
        deadline = time.monotonic() + 10
        while recorder.silent_open and time.monotonic() < deadline:
            time.sleep(0.1)
        assert recorder.silent_open == 0, f"{recorder.silent_open} upstream connections held"
    finally:
        finish(sp)
    # every faulty request, whatever failed under it, has its request event
    events = [json.loads(line) for line in sp.proxy.audit_file.read_text().splitlines() if line]
    requests = {(e.get("host"), e.get("path")) for e in events if e.get("event") == "request"}
    missing = [f"{name} {host}{path}{i}" for name, (host, path, _, _) in faults.items()
               for i in range(6) if (host, f"{path}{i}") not in requests]
    assert not missing, f"no request event for {len(missing)} faulty requests: {missing[:10]}"
