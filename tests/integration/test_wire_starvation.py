"""No client can starve the others (issue #20): one source holding thousands of silent
connections, while another source's requests are served.

Bounded counts, in the test's own network namespace: source A (127.0.44.10) opens 2,000 silent
TCP connections to a proxy with `--max-connections 600`; source B (127.0.44.11) then sends
requests with curl (CONNECT, TLS, a real upstream). Before the fix A held every slot for the
idle timeout and B's connections were closed at accept. Also: each admission deadline closes an
unidentified connection (first byte, TLS handshake, identification) and says so in the audit.
"""

from __future__ import annotations

import errno
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.integration.conftest import HERE, Proxy, split_status, start_proxy, stop_proxy
from tests.integration.test_wire import RAW_IP, RESOLVE, RESPONDERS
from tests.support.proxy_stack import token, vault_env
from tests.support.rawupstream import RawServer

pytestmark = pytest.mark.integration

SOURCE_A = "127.0.44.10"
SOURCE_B = "127.0.44.11"
SILENT = 2000


@pytest.fixture(scope="module")
def raw(pki) -> Iterator[RawServer]:
    s = RawServer(RAW_IP, 443, str(pki.cert), str(pki.key), responders=RESPONDERS).start()
    yield s
    s.stop()


def _proxy(tmp_path_factory, vault, pki, *extra: str) -> Proxy:
    return start_proxy(tmp_path_factory.mktemp("starve"), HERE / "policies_wire",
                       vault_env(vault), pki,
                       *[f"--resolve={n}={ip}" for n, ip in RESOLVE.items()], *extra)


@pytest.fixture(scope="module")
def capped(tmp_path_factory, vault, pki, raw) -> Iterator[Proxy]:
    """Default admission limits; a small total so that one source could fill it."""
    p = _proxy(tmp_path_factory, vault, pki, "--max-connections", "600")
    yield p
    stop_proxy(p)


@pytest.fixture(scope="module")
def short(tmp_path_factory, vault, pki, raw) -> Iterator[Proxy]:
    p = _proxy(tmp_path_factory, vault, pki, "--first-byte-timeout", "1",
               "--handshake-timeout", "1.5", "--identify-timeout", "3")
    yield p
    stop_proxy(p)


def _served_from_b(proxy: Proxy, n: int) -> list[tuple[int, str]]:
    """n requests from source B, each on its own connection: (status, curl's error)."""
    out = []
    for _ in range(n):
        r = subprocess.run(
            ["curl", "-sS", "--max-time", "10", "--interface", SOURCE_B, "--proxy", proxy.url,
             "--proxy-user", f"coding-agent:{token(proxy)}", "--cacert", str(proxy.ca),
             "-w", "\n%{http_code}", "https://raw.wire.test/host"],
            capture_output=True, text=True, timeout=30)
        body, status = split_status(r.stdout)
        out.append((status if body == "host=raw.wire.test\n" else -status, r.stderr.strip()))
    return out


def _silent_connections(proxy: Proxy, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind((SOURCE_A, 0))
        s.setblocking(False)
        err = s.connect_ex((proxy.host, proxy.port))
        assert err in (0, errno.EINPROGRESS), err
        socks.append(s)
    return socks


def _held_by_a(proxy: Proxy) -> int:
    """Connections from source A the proxy has accepted and keeps open (its side of them,
    ESTABLISHED: one it closed is past that state; the backlog is drained first, see below)."""
    out = subprocess.run(["ss", "-Htn", "state", "established", "(", "sport", "=",
                          f":{proxy.port}", ")", "dst", SOURCE_A],
                         capture_output=True, text=True, check=True).stdout
    return len(out.splitlines())


def test_one_source_cannot_starve_another(capped):
    baseline = _served_from_b(capped, 5)
    assert all(s == 200 for s, _ in baseline), baseline
    socks = _silent_connections(capped, SILENT)
    try:
        # Let the proxy accept what the backlog holds (closing those over the source's cap):
        # until the count of A's open connections stops moving (bounded).
        held, deadline = -1, time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(1)
            now = _held_by_a(capped)
            if now == held:
                break
            held = now
        during = _served_from_b(capped, 20)
        assert all(s == 200 for s, _ in during), [e for s, e in during if s != 200][:3]
        # one unidentified source holds at most --max-unidentified-per-source (128) slots
        assert held <= 128, held
        ev = [e for e in capped.audit() if e.get("event") == "limit"
              and "max-unidentified-per-source" in (e.get("reason") or "")]
        assert ev and ev[0]["code"] == "too_many_connections"
        assert ev[0]["client"].startswith(SOURCE_A + ":")
    finally:
        for s in socks:
            s.close()


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def _limit_event(proxy: Proxy, what: str) -> dict:
    return proxy.wait_audit(lambda e: e.get("event") == "limit"
                            and e.get("code") == "handshake_timeout"
                            and what in (e.get("reason") or ""))


def test_silent_connection_closed_at_the_first_byte_deadline(short):
    s = socket.create_connection((short.host, short.port))
    try:
        assert _closed_within(s, 10)
    finally:
        s.close()
    _limit_event(short, "sent nothing")


def test_stalled_tls_handshake_closed_at_its_deadline(short):
    """TLS to the proxy port that sends a ClientHello's first bytes and stops."""
    s = socket.create_connection((short.host, short.port))
    try:
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a record header, no more
        assert _closed_within(s, 10)
    finally:
        s.close()
    _limit_event(short, "TLS handshake")


def test_trickling_unidentified_head_closed_at_the_identify_deadline(short):
    """One header byte every half second keeps a head alive well within --header-timeout;
    unidentified, it may not hold its slot past --identify-timeout."""
    s = socket.create_connection((short.host, short.port))
    closed = False
    try:
        s.sendall(b"GET http://raw.wire.test/ HTTP/1.1\r\nHost: raw.wire.test\r\n")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not closed:
            try:
                s.sendall(b"X")
            except OSError:
                closed = True
                break
            closed = _closed_within(s, 0.5)
    finally:
        s.close()
    assert closed
    _limit_event(short, "not identified")


def test_identified_keepalive_connection_outlives_the_deadlines(short):
    """An identified connection is not subject to the admission deadlines."""
    auth = f"coding-agent:{token(short)}"
    import base64

    s = socket.create_connection((short.host, short.port))
    try:
        head = (b"CONNECT raw.wire.test:443 HTTP/1.1\r\nHost: raw.wire.test:443\r\n"
                b"Proxy-Authorization: Basic " + base64.b64encode(auth.encode()) + b"\r\n\r\n")
        s.sendall(head)
        assert b" 200 " in s.recv(4096)
        assert not _closed_within(s, 4)  # past --identify-timeout (3 s), still open
    finally:
        s.close()
