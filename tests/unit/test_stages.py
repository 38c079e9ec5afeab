"""The request's stages on their own (sandgate/stages), and the composition that orders them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.test import tflow

from sandgate.addons import gate as gate_addon
from sandgate.audit import events as audit
from sandgate.decision import decide
from sandgate.errors import Code, LimitExceeded, Refused
from sandgate.identity.base import Caller
from sandgate.identity.resolve import Identifier
from sandgate.inject import Leak
from sandgate.limits import LimitsConfig
from sandgate.policy.loader import load_policy_dir
from sandgate.policy.model import Policy
from sandgate.refusal import Refusal
from sandgate.request import RequestInfo
from sandgate.secrets.vault import SecretBroker, VaultConfig
from sandgate.stages import context, s20_head, s30_body, s80_refuse
from sandgate.stages.flow import FlowRecord, Tunnel

POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: docs, hosts: [docs.example], methods: [GET, POST], schemes: [http],
         max_request_bytes: 100}
"""


def load(tmp_path: Path, text: str, name: str = "pol") -> Policy:
    d = tmp_path / name
    d.mkdir()
    (d / "p.yaml").write_text(text)
    return load_policy_dir(d)


@pytest.fixture
def state(tmp_path: Path) -> context.GateState:
    policy = load(tmp_path, POLICY)
    broker = SecretBroker(VaultConfig(addr="http://127.0.0.1:9", token="x", role_id=None,
                                      secret_id=None, cacert=None, namespace=None),
                          policy.secrets)
    return context.GateState(context.GateConfig(
        policy=policy, broker=broker, identifier=Identifier(b"k" * 32),
        audit=audit.AuditLog(tmp_path / "audit.jsonl"), max_request_body=1000))


# --- the composition --------------------------------------------------------------------------

STAGES = Path(context.__file__).parent


def number(fn: object) -> int:
    match = re.fullmatch(r"sandgate\.stages\.s(\d+)_\w+", getattr(fn, "__module__", ""))
    assert match, f"{fn!r} is not a stage module's function"
    return int(match.group(1))


def test_the_listing_shows_the_order_the_request_path_takes():
    modules = sorted(p.stem for p in STAGES.glob("s[0-9]*_*.py"))
    assert [int(m[1:].split("_")[0]) for m in modules] == sorted(
        int(m[1:].split("_")[0]) for m in modules)
    path = [number(fn) for fn in (*gate_addon.HEAD_PATH, *gate_addon.REQUEST_PATH)]
    assert path == sorted(path) and len(set(path)) == len(path)
    # every module the request path names is in the listing
    assert {f"s{n}" for n in path} <= {m.split("_")[0] for m in modules}


def test_names_other_code_imports_stay_in_the_addon_module():
    for name in ("Gate", "GateConfig", "guarded", "via_gateway", "_record"):
        assert hasattr(gate_addon, name)
    assert issubclass(gate_addon.Gate, context.GateState)


# --- s20_head: bounds before anything else ----------------------------------------------------


def test_head_size_refused_past_either_limit():
    lim = LimitsConfig(max_headers=3, max_header_bytes=10_000)
    req = tflow.treq()
    while len(req.headers.fields) < 3:
        req.headers.add("x-pad", "1")
    s20_head.check_head_size(lim, req)  # exactly at the limit: accepted
    req.headers.add("x-one-more", "1")
    with pytest.raises(LimitExceeded) as e:
        s20_head.check_head_size(lim, req)
    assert e.value.code == Code.HEADERS_TOO_LARGE and "4 header fields" in e.value.reason

    small = LimitsConfig(max_headers=100, max_header_bytes=64)
    req = tflow.treq()
    req.headers["x-long"] = "v" * 100
    with pytest.raises(LimitExceeded) as e:
        s20_head.check_head_size(small, req)
    assert "at most 64 are accepted" in e.value.reason


@given(length=st.one_of(st.integers(min_value=0, max_value=1 << 40).map(str),
                        st.sampled_from(["", "abc", "-", "1.5"])),
       chunked=st.booleans())
def test_declared_length_and_expected_body_agree(length, chunked):
    req = tflow.treq()
    req.headers["content-length"] = length
    if chunked:
        req.headers["transfer-encoding"] = "chunked"
    declared = s20_head.declared_length(req)
    expected = s20_head.body_expected(req)
    if chunked:
        assert declared is None and expected == 1 << 62  # unknown: treated as large
    elif declared is not None:
        assert expected == declared
    else:
        assert expected == 1 << 62  # malformed: mitmproxy refuses it; never read it here
    assert s20_head.large_body(req) == (expected > s20_head.SMALL_BODY)


def test_body_limit_is_the_smaller_of_proxy_and_rule(state):
    policy = state.policy
    info = RequestInfo("http", "docs.example", 80, "POST", "/")
    rec = FlowRecord(decision=decide(policy, "agent", info))
    assert s20_head.body_limit(state, rec) == 100  # the rule's max_request_bytes
    with pytest.raises(Refused, match=r"max_request_bytes\) \(100 bytes\)"):
        s20_head.check_size(state, 101, 100)
    rec.reported = True  # report mode: no rule allowed it, so the proxy's limit
    assert s20_head.body_limit(state, rec) == 1000
    with pytest.raises(Refused, match=r"this proxy accepts \(1000 bytes\)"):
        s20_head.check_size(state, 1001, 1000)
    s20_head.check_size(state, 1000, 1000)


def test_tunnel_refusal_follows_a_reloaded_policy(tmp_path, state):
    old = state.policy
    tunnel = Tunnel(caller=Caller("agent", None, "token"), host="other.example", port=443,
                    rule=None, passthrough=False, refusal=Refused(Code.NO_RULE, "no rule"),
                    policy=old)
    allow_all = POLICY.replace("docs.example", "other.example").replace(
        "schemes: [http]", "schemes: [https]")
    new = load(tmp_path, allow_all, "new")
    s20_head.rejudge_tunnel(tunnel, new)
    assert tunnel.refusal is None and tunnel.policy is new
    s20_head.rejudge_tunnel(tunnel, old)
    assert tunnel.refusal is not None and tunnel.refusal.code == Code.NO_RULE


# --- s30_body: what a leak is called ----------------------------------------------------------


def test_exfiltration_names_secrets_and_rule_never_values():
    leaks = [Leak("gh", "value", "body"), Leak("gh", "value", "body"),
             Leak("aws", "placeholder", "header")]
    assert s30_body.leak_names(leaks) == ["aws:placeholder:header", "gh:value:body"]
    err = s30_body.exfiltration(leaks, None)
    assert err.code == Code.EXFILTRATION
    assert "secret(s) aws, gh that no rule allowing this request binds" in err.reason
    assert "does not" not in err.reason  # no double negative when no rule allowed it


def test_report_mode_has_no_allowing_rule(state):
    info = RequestInfo("http", "docs.example", 80, "GET", "/")
    rec = FlowRecord(decision=decide(state.policy, "agent", info))
    assert context.allowing_rule(rec) is not None
    rec.reported = True
    assert context.allowing_rule(rec) is None


# --- s80_refuse: the answer -------------------------------------------------------------------


def test_refusal_target_redacts_query_values():
    req = tflow.treq(path=b"/a?key=not-a-real-secret&x=1")
    assert s80_refuse.target_of(req).endswith("/a?key=REDACTED&x=REDACTED")
    assert "not-a-real-secret" not in s80_refuse.target_of(req)


@pytest.mark.parametrize(("code", "method", "closes"), [
    (Code.AUTH_REQUIRED, "GET", True),  # 407: the client retries with credentials anew
    (Code.NO_RULE, "CONNECT", True),  # a refused CONNECT ends its connection
    (Code.TOO_MANY_CONNECTIONS, "GET", True),
    (Code.NO_RULE, "GET", False),  # keep-alive: the next request is judged on its own
])
def test_refuse_closes_only_what_must_close(code, method, closes):
    f = tflow.tflow()
    f.request.method = method
    s80_refuse.refuse(f, Refusal(code, "refused"))
    assert f.response is not None and context.record(f).refused
    assert (f.response.headers.get("connection") == "close") == closes


def test_refusal_of_an_unparsed_request_names_its_target_redacted(state):
    f = tflow.tflow()
    f.request.path = "/nowhere?token=not-a-real-secret"
    refusal = s80_refuse.refusal_for(state, f, Refused(Code.NO_RULE, "no rule"))
    assert refusal.target is not None and "not-a-real-secret" not in refusal.target
    assert refusal.target.startswith("http://")  # a proxied request: its full target


def test_refusal_never_quotes_a_secret(state):
    decoy = "decoy-not-a-real-credential-value"
    state.cfg.canaries = {"canary:agent": decoy}
    state.set_policy(state.policy)  # the secret set is rebuilt with the decoy
    f = tflow.tflow()
    f.request.path = f"/x?q={decoy}"
    error = Refused(Code.BAD_REQUEST, f"the header says {decoy}", hint=f"drop {decoy}")
    refusal = s80_refuse.refusal_for(state, f, error)
    for text in (refusal.reason, refusal.hint, refusal.target, refusal.body().decode()):
        assert text is not None and decoy not in text


CALL_POLICY = """
version: v1
identities:
  agent:
    rules:
      - {name: read, hosts: [docs.example], methods: [POST], schemes: [http],
         mcp: {tools: ['get_*']}}
      - {name: write, hosts: [docs.example], methods: [POST], schemes: [http],
         mcp: {tools: [create_issue]}, max_request_bytes: 150}
"""


async def test_the_call_stage_holds_the_body_to_the_rule_the_call_picked(tmp_path, state):
    """The head picks `read`; a create_issue call is allowed by `write` only, and the body
    stage runs again for it: its max_request_bytes counts, not the head rule's."""
    import json

    from sandgate.stages import s35_call

    policy = load(tmp_path, CALL_POLICY, "calls")
    state.set_policy(policy)
    info = RequestInfo("http", "docs.example", 80, "POST", "/")

    def run(title: str) -> tuple[FlowRecord, http.HTTPFlow]:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                           "params": {"name": "create_issue",
                                      "arguments": {"title": title}}}).encode()
        f = tflow.tflow(req=tflow.treq(method=b"POST", host="docs.example", port=80,
                                       path=b"/", content=body))
        rec = context.record(f)
        rec.caller, rec.info, rec.policy = Caller("agent", None, "token"), info, policy
        rec.decision = decide(policy, "agent", info)
        assert rec.decision.rule is not None and rec.decision.rule.name == "read"
        return rec, f

    rec, f = run("short")
    await s30_body.check(state, f, rec)
    await s35_call.judge(state, f, rec)
    assert rec.decision is not None and rec.decision.rule is not None
    assert rec.decision.rule.name == "write" and not rec.refused
    rec, f = run("x" * 200)
    await s30_body.check(state, f, rec)  # the head rule's limit (the proxy's 1000) lets it in
    with pytest.raises(Refused) as ei:
        await s35_call.judge(state, f, rec)
    assert ei.value.code == Code.TOO_LARGE and "150" in ei.value.reason
