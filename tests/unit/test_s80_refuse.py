"""The 407 challenge (docs/clients.md#proxy-credentials-after-a-407-challenge): a request or
CONNECT that carried no proxy credentials is answered with `Proxy-Authenticate: Basic
realm="sandgate"` and the connection closed, and audited with decision `challenge`, not
`deny`; wrong credentials, the SOCKS5 listener and the gateway's 401 stay refusals. End to end
with curl --proxy-anyauth and urllib: tests/integration/test_proxy_challenge.py."""

from __future__ import annotations

from typing import Any

import pytest
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import tflow

from sandgate.audit import events as A
from sandgate.errors import Code
from sandgate.refusal import Refusal
from sandgate.stages.context import record
from sandgate.stages.s80_refuse import refuse


def _refused(code: Code, method: str = "GET", gateway: bool = False,
             mode: str = "regular") -> tuple[Any, dict[str, Any]]:
    flow = tflow.tflow()
    flow.request.method = method
    flow.client_conn.proxy_mode = ProxyMode.parse(mode)
    refuse(flow, Refusal(code, "why", gateway=gateway))
    return flow, A.flow_fields(flow, record(flow))


@pytest.mark.parametrize("method", ["GET", "POST", "CONNECT"])
def test_no_credentials_is_a_challenge(method: str) -> None:
    flow, fields = _refused(Code.AUTH_REQUIRED, method)
    assert flow.response.status_code == 407
    assert flow.response.headers["Proxy-Authenticate"] == 'Basic realm="sandgate"'
    assert flow.response.headers["connection"] == "close"  # no body read before the caller
    assert fields[A.DECISION] == "challenge" and fields[A.CODE] == "auth_required"


@pytest.mark.parametrize(("code", "gateway", "mode", "status"), [
    (Code.AUTH_INVALID, False, "regular", 407),  # sent, and wrong: a refusal
    (Code.AUTH_REQUIRED, True, "regular", 401),  # the gateway: its own token header
    (Code.AUTH_REQUIRED, False, "socks5", 407),  # SOCKS5 has no challenge to answer
    (Code.NO_RULE, False, "regular", 403),
])
def test_everything_else_stays_a_refusal(code: Code, gateway: bool, mode: str,
                                         status: int) -> None:
    flow, fields = _refused(code, gateway=gateway, mode=mode)
    assert flow.response.status_code == status
    assert fields[A.DECISION] == "deny"


def test_a_challenge_is_an_informational_logon_in_ocsf() -> None:
    from sandgate.audit import ocsf as audit_ocsf

    _, fields = _refused(Code.AUTH_REQUIRED, "CONNECT")
    e = audit_ocsf.to_ocsf({"time": "2026-11-28T12:00:00Z", "event": "connect", **fields})
    assert (e["class_uid"], e["activity_id"]) == (3002, 1)
    assert e["severity_id"] == 1 and e["status_code"] == "auth_required"
    _, denied = _refused(Code.AUTH_INVALID, "CONNECT")
    assert audit_ocsf.to_ocsf({"time": "2026-11-28T12:00:00Z", "event": "connect",
                               **denied})["severity_id"] == 3
