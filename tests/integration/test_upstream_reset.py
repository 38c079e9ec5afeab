"""An upstream that resets right after accepting: always a 502 `upstream_error`, never silence.

The soak test's "hangup" fault sometimes got no answer at all (about once in three full CI
runs). Cause: when the RST lands after the proxy's TCP connect completed but before asyncio
built the connection's transport (the event loop was busy with other clients), getpeername()
fails there, and mitmproxy 11.0.2's dialler died on its peername assertion without telling the
layer that waited for the connection. Here the busy loop is made certain instead of hoped for:
a `sitecustomize` in the proxy process (tests/integration/slowdial/) holds the event loop's
dial of 127.0.15.0/24 addresses for 200 ms between the connect and the transport, and the
upstream resets 50 ms after accepting, so the RST is always there before the transport.
Before the fix every request below hung until curl gave up (15 s, 0 bytes).

Real parts: the sandgate CLI, OpenBao, curl, an upstream on 127.0.15.7:443 that accepts and
closes with SO_LINGER 0.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Proxy, curl, split_status, start_proxy, stop_proxy
from tests.support.hangup import HangUp

pytestmark = pytest.mark.integration

HANGUP_IP = "127.0.15.7"
SHIM = Path(__file__).parent / "slowdial"

POLICY = """\
version: v1
identities:
  agent:
    rules:
      - {name: hangup, hosts: [hangup.rst.test], methods: [GET], private_cidrs: [127.0.15.0/24]}
"""


@pytest.fixture(scope="module")
def hangup() -> Iterator[HangUp]:
    h = HangUp(HANGUP_IP)
    yield h
    h.close()


def _proxy(tmp: Path, vault, pki, slow: bool) -> Proxy:
    pol = tmp / "policies"
    pol.mkdir()
    (pol / "reset.yaml").write_text(POLICY)
    env = {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}
    if slow:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SHIM), *filter(None, [os.environ.get("PYTHONPATH")])])
        env["SANDGATE_TEST_SLOW_DIAL"] = "127.0.15."
    return start_proxy(tmp, pol, env, pki, f"--resolve=hangup.rst.test={HANGUP_IP}",
                       "--upstream-connect-timeout", "2", "--upstream-read-timeout", "2")


@pytest.mark.parametrize("slow", [True, False], ids=["rst-before-transport", "natural"])
def test_reset_after_accept_is_502(tmp_path, vault, pki, hangup, slow: bool) -> None:
    """Bounds: 4 requests, each on its own CONNECT tunnel; curl's limit 15 s, answers in < 5 s
    each. Each gets 502 with the refusal body and its request event; the dial was made."""
    p = _proxy(tmp_path, vault, pki, slow)
    # Held dials: the RST comes 50 ms after accept, so the connect itself always succeeds and
    # the RST lands while the dial is held (200 ms), before the transport. Natural: at once
    # (the connect itself may then see the reset: mitmproxy's own dial error, also a 502).
    hangup.delay = 0.05 if slow else 0.0
    try:
        token = p.token("agent")
        before = hangup.accepted
        for i in range(4):
            started = time.monotonic()
            r = curl(p, "agent", f"https://hangup.rst.test/x{i}", token=token)
            body, status = split_status(r.stdout)
            assert status == 502, f"request {i}: {r.stdout!r} {r.stderr!r}"
            assert time.monotonic() - started < 5
            refusal = json.loads(body)
            assert (refusal["error"], refusal["code"], refusal["status"]) == (
                "sandgate_refused", "upstream_error", 502)
            # the request event: allowed, dialled, and the upstream's failure as its error
            ev = p.wait_audit(lambda e, i=i: e.get("event") == "request"
                              and e.get("path") == f"/x{i}" and bool(e.get("error")))
            assert ev["dialed"] == f"{HANGUP_IP}:443"
            if slow:
                assert "reset the connection" in ev["error"]
        assert hangup.accepted - before >= 4  # the upstream was really dialled each time
        if slow:  # the shim did hold the dials: this was the race, not a lucky order
            assert "slowdial: held" in p.logs()
    finally:
        stop_proxy(p)
