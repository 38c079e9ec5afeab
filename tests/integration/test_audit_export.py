"""Audit export to real receivers: Arize Phoenix (an OpenTelemetry collector from the package
index, OTLP/HTTP) and Debian's rsyslogd (imtcp, plain and TLS with the gtls driver).

A request with a known `traceparent` goes through the proxy: Phoenix stores Sandgate's span as
the child of that parent, with children for the Vault fetch, the dial and the upstream exchange,
and the upstream never sees the header unless the rule forwards it. rsyslog receives every
audit event as RFC 5424. With the collectors down, requests still pass and the audit file is
complete. No exported byte carries a secret value, in any encoding.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

from tests.integration.conftest import (
    HERE,
    OPENAI_KEY,
    SANDGATE,
    SECRET_VALUES,
    Proxy,
    curl,
    split_status,
    start_proxy,
    stop_proxy,
)
from tests.support.ocsf_schema import check
from tests.support.phoenix import Phoenix
from tests.support.pki import make_pki
from tests.support.rsyslog import Rsyslog
from tests.support.secrets import fingerprint

pytestmark = pytest.mark.integration

POLICIES = HERE / "policies_export"
PHOENIX_IP = "127.0.67.1"
SYSLOG_IP = "127.0.67.2"
SYSLOG_TLS_PORT = 6514
SYSLOG_TCP_PORT = 10514
DEAD_IP = "127.0.67.9"  # nothing listens here: the collectors that are down
OCSF_SYSLOG_IP = "127.0.70.1"  # the rsyslog of the --audit-format ocsf case
ADMIN_TOKEN = "test-admin-token-export-4e1a"
CHAT = "https://api.openai.com/v1/chat/completions"


def encoded_forms(value: str) -> list[bytes]:
    """A secret as raw bytes, base64 (standard and URL-safe, at each alignment inside a longer
    text), URL-encoded and hex: what an export must carry in none of its forms."""
    raw = value.encode()
    forms = [raw, urllib.parse.quote(value, safe="").encode(), urllib.parse.quote_plus(
        value).encode(), binascii.hexlify(raw), binascii.hexlify(raw).upper()]
    for k in range(3):
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            text = enc(b"x" * k + raw)
            forms.append(text[4 if k else 0:-4])
    return forms


def assert_no_secret_form(data: bytes, what: str) -> None:
    for value in SECRET_VALUES:
        for form in encoded_forms(value):
            if form in data:
                raise AssertionError(f"{what} carries secret {fingerprint(value)} in some form")


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory) -> Iterator[Phoenix]:
    p = Phoenix(tmp_path_factory.mktemp("phoenix"), PHOENIX_IP).launch()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def syslog_pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("syslog-pki"), ["syslog.test"], ips=[SYSLOG_IP])


@pytest.fixture(scope="module")
def rsyslog_tls(tmp_path_factory, syslog_pki) -> Iterator[Rsyslog]:
    r = Rsyslog(tmp_path_factory.mktemp("rsyslog-tls"), SYSLOG_IP, SYSLOG_TLS_PORT,
                cert=syslog_pki.cert, key=syslog_pki.key, ca=syslog_pki.ca_cert).start()
    yield r
    r.stop()


def env(vault, **extra: str) -> dict[str, str]:
    return {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
            "SANDGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s, not the SDK's 5 s
            **extra}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, phoenix, vault, upstream, pki, rsyslog_tls,
          syslog_pki) -> Iterator[Proxy]:
    # phoenix first: its start overlaps the others'; it is up before the first request
    p = start_proxy(tmp_path_factory.mktemp("proxy-export"), POLICIES, env(vault), pki,
                    "--otlp", phoenix.url,
                    "--audit-syslog", f"tcp+tls://{SYSLOG_IP}:{SYSLOG_TLS_PORT}",
                    "--audit-syslog-ca", str(syslog_pki.ca_cert))
    phoenix.ready()
    yield p
    stop_proxy(p)


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def attrs(span: dict) -> dict:
    """Phoenix nests dotted attribute names ({"sandgate": {"decision": ...}}): flatten."""
    out: dict = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", span.get("attributes") or {})
    return out


def test_the_span_continues_the_sandbox_trace_and_the_header_stays_here(proxy, phoenix,
                                                                        upstream):
    trace_id, parent_id, header = traceparent()
    before = len(upstream.upstream.seen)
    out = curl(proxy, "agent", CHAT, "-X", "POST", "-d", "{}", "-H",
               "content-type: application/json", "-H", f"traceparent: {header}",
               "-H", "tracestate: vendor=abc")
    _, status = split_status(out.stdout)
    assert status == 200, out.stderr
    seen = upstream.upstream.seen[before:]
    assert len(seen) == 1
    assert "traceparent" not in seen[0].headers and "tracestate" not in seen[0].headers

    spans = phoenix.wait_spans(trace_id, 4)
    by_name = {s["name"]: s for s in spans}
    main = by_name["POST api.openai.com"]
    assert main["parent_id"] == parent_id  # the agent's own span is the parent
    a = attrs(main)
    assert a["sandgate.decision"] == "allow"
    assert a["sandgate.identity"] == "agent"
    assert a["sandgate.rule"] == "openai"
    assert [s.split("@")[0] for s in a["sandgate.secrets"]] == ["openai"]
    assert a["http.response.status_code"] == 200
    assert a["server.address"] == "api.openai.com"
    assert a["url.path"] == "/v1/chat/completions"
    # the durations of the parts: children of Sandgate's span
    for child in ("vault fetch", "dial", "upstream"):
        assert by_name[child]["parent_id"] == main["context"]["span_id"], child
        assert by_name[child]["context"]["trace_id"] == trace_id
    assert attrs(by_name["upstream"])["http.response.status_code"] == 200


def test_a_rule_may_forward_the_trace_context(proxy, phoenix, upstream):
    trace_id, parent_id, header = traceparent()
    before = len(upstream.upstream.seen)
    out = curl(proxy, "agent", "https://upstream.test/traced/x", "-H", f"traceparent: {header}",
               "-H", "tracestate: vendor=abc")
    assert split_status(out.stdout)[1] == 200, out.stderr
    seen = upstream.upstream.seen[before:]
    assert seen[0].headers["traceparent"] == header
    assert seen[0].headers["tracestate"] == "vendor=abc"
    main = next(s for s in phoenix.wait_spans(trace_id, 1) if s["name"] == "GET upstream.test")
    assert main["parent_id"] == parent_id
    # explain says the same of this rule
    explained = subprocess.run(
        [*SANDGATE, "explain", "--policies", str(POLICIES), "--identity", "agent", "GET",
         "https://upstream.test/traced/x"],
        capture_output=True, text=True, check=True)
    assert "forwarded to the upstream" in json.loads(explained.stdout)["trace_context"]


def test_a_refusal_is_a_span_of_the_sandbox_trace_too(proxy, phoenix):
    trace_id, parent_id, header = traceparent()
    out = curl(proxy, "agent", "https://upstream.test/elsewhere", "-H", f"traceparent: {header}")
    assert split_status(out.stdout)[1] == 403
    main = phoenix.wait_spans(trace_id, 1)[0]
    assert main["parent_id"] == parent_id
    assert main["status_code"] == "ERROR"
    a = attrs(main)
    assert a["sandgate.decision"] == "deny" and a["sandgate.code"] == "no_rule"


def test_tunnels_have_spans(proxy, phoenix):
    curl(proxy, "agent", CHAT, "-X", "POST", "-d", "{}")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        tunnels = [s for s in phoenix.spans() if s["name"] == "CONNECT api.openai.com:443"]
        if tunnels:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("no CONNECT span")
    a = attrs(tunnels[0])
    assert a["sandgate.event"] == "connect" and a["sandgate.decision"] == "allow"


def test_every_audit_event_reaches_rsyslog_over_tls(proxy, rsyslog_tls):
    marker = f"/v1/chat/completions?m={secrets.token_hex(4)}"  # query values are redacted
    curl(proxy, "agent", "https://api.openai.com" + marker, "-X", "POST", "-d", "{}")
    curl(proxy, "agent", "https://upstream.test/denied-" + secrets.token_hex(4))
    event = proxy.wait_audit(lambda e: e.get("code") == "no_rule" and e.get("path", "")
                             .startswith("/denied-"))
    line = rsyslog_tls.wait_for(event["path"])
    assert line.startswith("<109>1 ")  # log audit (13), notice: a refusal
    assert ' code="no_rule"' in line and ' identity="agent"' in line
    body = json.loads(line.split("\ufeff", 1)[1])
    assert body["path"] == event["path"] and body["decision"] == "deny"
    # rsyslog parsed what we framed: APP-NAME, MSGID and the structured data
    parsed = [p for p in rsyslog_tls.lines("parsed") if event["path"].split("-")[1] in p
              or "no_rule" in p]
    assert any(p.startswith("sandgate|request|[sandgate@32473 ") for p in parsed)
    # the documented template gives the audit event back, one JSON object a line
    assert any(json.loads(j).get("path") == event["path"] for j in rsyslog_tls.lines("json"))
    allowed = rsyslog_tls.wait_for("m=REDACTED")
    assert allowed.startswith("<110>1 ") and ' decision="allow"' in allowed


def test_each_worker_sends_its_own_events(tmp_path, vault, upstream, pki, rsyslog_tls,
                                          syslog_pki):
    p = start_proxy(tmp_path, POLICIES, env(vault), pki, "--workers", "2",
                    "--audit-syslog", f"tcp+tls://{SYSLOG_IP}:{SYSLOG_TLS_PORT}",
                    "--audit-syslog-ca", str(syslog_pki.ca_cert))
    try:
        path = f"/workers-{secrets.token_hex(4)}"
        curl(p, "agent", "https://upstream.test" + path)
        line = rsyslog_tls.wait_for(path)
        assert json.loads(line.split("\ufeff", 1)[1])["worker"] in (0, 1)
        assert ' worker="' in line
    finally:
        stop_proxy(p)


def test_no_exported_byte_carries_a_secret(proxy, phoenix, rsyslog_tls):
    # after the requests above (this module runs in order): everything the receivers hold
    curl(proxy, "agent", CHAT, "-X", "POST", "-d", "{}")
    proxy.wait_audit(lambda e: e.get("rule") == "openai")
    # a sandbox that somehow holds the value puts it, in several encodings, where it can: the
    # path (into span attributes and syslog fields) and the tracestate (a trace context carrying
    # a held value is not continued)
    raw = OPENAI_KEY.encode()
    b64, hexed = base64.b64encode(raw).decode(), binascii.hexlify(raw).decode()
    leak = f"/leak/{OPENAI_KEY}/{b64}/{hexed}"
    curl(proxy, "agent", "https://upstream.test" + leak, "-H", f"traceparent: {traceparent()[2]}",
         "-H", f"tracestate: k={OPENAI_KEY}")
    proxy.wait_audit(lambda e: str(e.get("path", "")).startswith("/leak/"))
    rsyslog_tls.wait_for("/leak/")
    deadline = time.monotonic() + 15
    while b"/leak/" not in phoenix.raw():  # the scan reads the spans of these requests too
        assert time.monotonic() < deadline, "the /leak/ span did not arrive"
        time.sleep(0.2)
    assert b"openai" in phoenix.raw()
    assert_no_secret_form(phoenix.raw(), "Phoenix's spans")
    assert_no_secret_form(rsyslog_tls.raw.read_bytes(), "rsyslog's messages")
    assert_no_secret_form(proxy.log_file.read_bytes(), "the proxy's log")


def test_spans_go_over_grpc_too(tmp_path, phoenix, vault, upstream, pki):
    p = start_proxy(tmp_path, POLICIES, env(vault, OTEL_EXPORTER_OTLP_PROTOCOL="grpc"), pki,
                    "--otlp", f"http://{PHOENIX_IP}:{phoenix.grpc_port}")
    try:
        trace_id, parent_id, header = traceparent()
        out = curl(p, "agent", "https://upstream.test/traced/grpc", "-H",
                   f"traceparent: {header}")
        assert split_status(out.stdout)[1] == 200, out.stderr
        main = next(s for s in phoenix.wait_spans(trace_id, 1) if s["name"] == "GET upstream.test")
        assert main["parent_id"] == parent_id
    finally:
        stop_proxy(p)


def metric(p: Proxy, admin: tuple[str, int], name: str, sink: str) -> float:
    req = urllib.request.Request(f"http://{admin[0]}:{admin[1]}/metrics",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f'{name}_total{{sink="{sink}"}}'):
                return float(line.split()[-1])
    return 0.0


def test_collectors_down_cost_no_request_and_no_audit_line(tmp_path, vault, upstream, pki):
    admin = ("127.0.67.3", 9901)
    p = start_proxy(tmp_path, POLICIES, env(vault, OTEL_EXPORTER_OTLP_TIMEOUT="1"), pki,
                    "--otlp", f"http://{DEAD_IP}:4318",
                    "--audit-syslog", f"tcp://{DEAD_IP}:{SYSLOG_TCP_PORT}",
                    "--admin", f"{admin[0]}:{admin[1]}")
    try:
        for _ in range(3):
            out = curl(p, "agent", CHAT, "-X", "POST", "-d", "{}")
            assert split_status(out.stdout)[1] == 200, out.stderr
        events = [e for e in p.audit() if e.get("event") == "request"]
        assert len(events) == 3 and all(e["decision"] == "allow" for e in events)
        # the spans the collector did not take are counted (after the exporter's 1 s timeout)
        deadline = time.monotonic() + 15
        while metric(p, admin, "sandgate_export_dropped", "otlp") < 1:
            assert time.monotonic() < deadline, "no dropped span counted"
            time.sleep(0.2)
    finally:
        stop_proxy(p)


def test_syslog_reconnects_and_delivers_what_it_queued(tmp_path, vault, upstream, pki):
    """The collector starts after the proxy and the first requests: the queued messages arrive
    once it is up (the sender dials again with backoff), and so do later ones."""
    receiver = Rsyslog(tmp_path / "rsyslog", SYSLOG_IP, SYSLOG_TCP_PORT)
    p = start_proxy(tmp_path, POLICIES, env(vault), pki,
                    "--audit-syslog", f"tcp://{SYSLOG_IP}:{SYSLOG_TCP_PORT}")
    try:
        first = f"/early-{secrets.token_hex(4)}"
        curl(p, "agent", "https://upstream.test" + first)
        receiver.start()
        receiver.wait_for(first)
        later = f"/later-{secrets.token_hex(4)}"
        curl(p, "agent", "https://upstream.test" + later)
        receiver.wait_for(later)
        receiver.stop()  # the collector goes away: requests go on, the audit file has them
        gone = f"/gone-{secrets.token_hex(4)}"
        assert split_status(curl(p, "agent", "https://upstream.test" + gone).stdout)[1] == 403
        p.wait_audit(lambda e: e.get("path") == gone)
        receiver.start()  # back: the sender finds the broken connection and dials again
        back = f"/back-{secrets.token_hex(4)}"
        curl(p, "agent", "https://upstream.test" + back)
        receiver.wait_for(back)
    finally:
        stop_proxy(p)
        receiver.stop()


def test_with_audit_format_ocsf_syslog_sends_ocsf(tmp_path, vault, upstream, pki):
    """`--audit-format ocsf`: the syslog MSG is the OCSF event the audit file holds (with
    Sandgate's own fields under `unmapped`), not Sandgate's JSON."""
    receiver = Rsyslog(tmp_path / "rsyslog", OCSF_SYSLOG_IP, SYSLOG_TCP_PORT).start()
    p = start_proxy(tmp_path, POLICIES, env(vault), pki, "--audit-format", "ocsf",
                    "--audit-syslog", f"tcp://{OCSF_SYSLOG_IP}:{SYSLOG_TCP_PORT}")
    try:
        path = f"/ocsf-{secrets.token_hex(4)}"
        assert split_status(curl(p, "agent", "https://upstream.test" + path).stdout)[1] == 403
        line = receiver.wait_for(path)
        assert ' code="no_rule"' in line  # the structured data stays Sandgate's
        body = json.loads(line.split("\ufeff", 1)[1])
        assert body["class_uid"] == 4002 and body["metadata"]["version"] == "1.8.0"
        assert body["unmapped"]["path"] == path and body["status_code"] == "no_rule"
        check(body)
        sent = [json.loads(j) for j in receiver.lines("json")]
        assert sent and all("class_uid" in j for j in sent), "a message not in OCSF"
    finally:
        stop_proxy(p)
        receiver.stop()
