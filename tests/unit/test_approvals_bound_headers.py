"""An approval binds the forwarded headers (approvals/headers.py, issue 34): the digest's
properties (hypothesis), what approvers see of the headers (scrubbed, placeholders named,
injected credentials by name only) in the admin API's document, the webhook and the CLI, and
the service: a retry or a remembered grant is matched only with the headers that were
approved."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.approvals import bound_headers as H
from sandgate.approvals.service import Approvals, Request
from sandgate.approvals.store import MemoryStore
from sandgate.approvals.votes import Approval, Scope, grant_for, vote
from sandgate.approvals.webhook import body_for
from sandgate.cli.approvals import header_lines, line
from sandgate.errors import ApprovalRefused, Code
from sandgate.policy.model import Source, Webhook
from sandgate.scrub.scrubber import SecretSet
from tests.unit.test_approvals import approval, ask_rule, load, pending_one, rule

pytestmark = pytest.mark.unit

Fields = list[tuple[bytes, bytes]]

# names the digest binds: no hop-by-hop, Proxy-*, X-Sandgate-*, Host or Content-Length
HOP_BY_HOP = [b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding",
              b"upgrade", b"http2-settings", b"proxy-authorization", b"proxy-connection",
              b"proxy-whatever", b"x-sandgate-reason", b"host", b"content-length"]
_token = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
names = _token.filter(lambda s: not s.startswith("sandgate-")).map(
    lambda s: ("x-" + s).encode()) | st.sampled_from(
    [b"content-type", b"x-http-method-override", b"x-target-env", b"accept", b"cookie"])
values = st.binary(max_size=20).filter(lambda v: b"\r" not in v and b"\n" not in v)
fields_st = st.lists(st.tuples(names, values), max_size=8)


def digest(fields: Fields, websocket: bool = False, dropped: frozenset[str] = frozenset()
           ) -> str:
    return H.digest(H.bound_fields(fields, dropped), websocket)


@st.composite
def with_hop_by_hop(draw: st.DrawFn, fields: Fields) -> Fields:
    """`fields` with hop-by-hop and proxy headers inserted anywhere (a Connection header
    nominates only names the fields do not have: nominating one would drop it for real)."""
    out = list(fields)
    present = {n.lower() for n, _ in fields}
    for _ in range(draw(st.integers(0, 5))):
        name = draw(st.sampled_from(HOP_BY_HOP))
        if name == b"connection":
            extra = draw(st.lists(names.filter(lambda n: n.lower() not in present), max_size=2))
            value = b", ".join([b"keep-alive", *extra])
            out.insert(draw(st.integers(0, len(out))), (name, value))
            for n in extra:  # the nominated ones, now hop-by-hop
                out.insert(draw(st.integers(0, len(out))), (n, draw(values)))
            continue
        out.insert(draw(st.integers(0, len(out))), (draw(st.sampled_from([name, name.upper()])),
                                                    draw(values)))
    return out


@given(st.data(), fields_st)
def test_digest_ignores_hop_by_hop_proxy_and_framing_headers(data, fields):
    assert digest(data.draw(with_hop_by_hop(fields))) == digest(fields)


@given(fields_st, st.randoms())
def test_digest_ignores_name_case_and_the_order_of_distinct_names(fields, rnd):
    recased = [("".join(rnd.choice([c.upper(), c.lower()]) for c in n.decode()).encode(), v)
               for n, v in fields]
    # shuffled, keeping the order of each name's own values
    by_name: dict[bytes, list[tuple[bytes, bytes]]] = {}
    for n, v in recased:
        by_name.setdefault(n.lower(), []).append((n, v))
    queues = list(by_name.values())
    shuffled = []
    while queues:
        q = rnd.choice(queues)
        shuffled.append(q.pop(0))
        if not q:
            queues.remove(q)
    assert digest(shuffled) == digest(fields)


@given(fields_st, st.data())
def test_digest_changes_with_any_forwarded_value_name_or_repeat_order(fields, data):
    base = digest(fields)
    assert digest([*fields, (data.draw(names), data.draw(values))]) != base  # one more
    if fields:
        i = data.draw(st.integers(0, len(fields) - 1))
        n, v = fields[i]
        other = data.draw(values.filter(lambda x, v=v: x != v))
        assert digest([*fields[:i], (n, other), *fields[i + 1:]]) != base  # another value
        assert digest(fields[:i] + fields[i + 1:]) != base  # one less
    # the same name twice: the upstream sees the values in order, so the order is bound
    a = data.draw(values)
    b = data.draw(values.filter(lambda x: x != a))
    assert digest([*fields, (b"x-twice", a), (b"x-twice", b)]) != digest(
        [*fields, (b"x-twice", b), (b"x-twice", a)])


@given(fields_st)
def test_digest_binds_the_websocket_switch_and_skips_what_sandgate_replaces(fields):
    assert digest(fields, websocket=True) != digest(fields)
    dropped = frozenset({"authorization", "accept-encoding"})
    assert digest([*fields, (b"Authorization", b"Bearer x"), (b"accept-encoding", b"br")],
                  dropped=dropped) == digest(fields, dropped=dropped)


def test_the_fields_bound_are_lower_case_and_sorted_by_name_keeping_repeats_in_order():
    got = H.bound_fields([(b"X-B", b"2"), (b"Host", b"h"), (b"x-a", b"1"), (b"X-B", b"1"),
                          (b"Connection", b"x-c"), (b"x-c", b"hop"), (b"Content-Length", b"3")])
    assert got == (("x-a", b"1"), ("x-b", b"2"), ("x-b", b"1"))


def test_what_sandgate_replaces_follows_the_rule(tmp_path):
    p = load(tmp_path, "secrets:\n  gh: {vault: secret/data/gh, field: token}\n" + rule(
        "      - {name: a, action: ask, hosts: [x.example.com], inject: {headers: "
        "{X-Api-Key: '{{ secrets.gh }}'}}}\n"
        "      - {name: b, action: ask, hosts: [y.example.com], forward_trace_context: true}"))
    a, b = p.identities["agent"].rules[:2]
    assert H.injected(a) == ("x-api-key",) and H.injected(b) == ()
    assert H.replaced(a) == {"x-api-key", "accept-encoding", "traceparent", "tracestate"}
    assert H.replaced(b) == {"accept-encoding"}  # the trace context is forwarded: bound


# --------------------------------------------------------------------------- what approvers see

FAKE_SECRET = "test-fake-secret-value-7f3a"
PLACEHOLDER = "sandgate-placeholder-gh"


def test_approvers_see_the_headers_scrubbed():
    scrub = H.scrubber(SecretSet({"gh": FAKE_SECRET}), {PLACEHOLDER: "gh",
                                                        PLACEHOLDER + "-admin": "gh-admin"})
    import base64

    shown = H.shown(H.bound_fields([
        (b"x-leak", f"token={FAKE_SECRET}".encode()),
        (b"x-b64", base64.b64encode(FAKE_SECRET.encode())),
        (b"authorization", f"Bearer {PLACEHOLDER}".encode()),
        (b"x-admin", f"{PLACEHOLDER}-admin".encode()),
        (b"x-target-env", b"production"),
        (b"x-long", b"v" * 2000),
    ]), scrub)
    d = dict(shown)
    assert d["x-leak"] == "token=[REDACTED:gh]" and d["x-b64"] == "[REDACTED:gh]"
    assert d["authorization"] == "Bearer [PLACEHOLDER:gh]"
    assert d["x-admin"] == "[PLACEHOLDER:gh-admin]"  # the longer placeholder first
    assert d["x-target-env"] == "production"
    assert d["x-long"].startswith("v" * H.MAX_SHOWN) and "1488 more characters" in d["x-long"]
    assert FAKE_SECRET not in json.dumps(shown) and PLACEHOLDER not in json.dumps(shown)


_SECRET_SET = SecretSet({"gh": FAKE_SECRET})
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)


@given(st.lists(st.tuples(_text, _text, st.sampled_from(["", FAKE_SECRET, PLACEHOLDER])),
                max_size=6), st.integers(0, 700))
def test_no_secret_value_or_placeholder_is_ever_shown(parts, pad):
    """Whatever surrounds them, and however long the value (the cut comes after the scrub)."""
    fields = [(f"x-h{i}".encode(), (a + s + b + "v" * pad).encode())
              for i, (a, b, s) in enumerate(parts)]
    shown = json.dumps(H.shown(H.bound_fields(fields), H.scrubber(_SECRET_SET,
                                                                    {PLACEHOLDER: "gh"})))
    assert FAKE_SECRET not in shown and PLACEHOLDER not in shown


def test_the_approval_document_webhook_and_cli_show_the_headers():
    a = approval(headers=(("x-target-env", "production"), ("x-note", "<!channel> \x1b[2J")),
                 headers_injected=("authorization",))
    doc = a.as_dict()
    assert doc["headers"] == [["x-target-env", "production"], ["x-note", "<!channel> \x1b[2J"]]
    assert doc["headers_injected"] == ["authorization"] and doc["headers_sha256"] == "a" * 64
    assert Approval.from_dict(json.loads(json.dumps(doc))) == a  # as Redis keeps it
    hook = Webhook("ops", "https://h.example.com", "slack", None, Source("p.yaml", 1))
    slack = json.dumps(body_for(hook, a))
    assert "x-target-env: production" in slack and "authorization: [injected by Sandgate]" in slack
    assert "<!channel>" not in slack and "&lt;!channel&gt;" in slack  # no markup of the sandbox's
    raw = body_for(Webhook("j", "https://h.example.com", "json", None, Source("p", 1)), a)
    assert raw["approval"]["headers"] == doc["headers"]
    printed = "\n".join([line(doc), *header_lines(doc)])
    assert "    x-target-env: production" in printed and "\x1b" not in printed
    assert "x-note: <!channel> \\x1b[2J" in printed
    assert "authorization: [injected by Sandgate]" in printed


def test_an_approval_says_what_it_binds():
    a = approval()
    assert a.as_dict()["binds"] == {
        "kind": "request", "identity": "agent", "sandbox": "sb-1", "method": "DELETE",
        "url": "https://api.example.com/repos/x", "body_sha256": "0" * 64,
        "headers_sha256": "a" * 64}
    b = vote(vote(a, "alice", "approve", Scope("sandbox", 60), None, 1001), "bob", "approve",
             Scope("sandbox", 60), None, 1002)
    assert b.as_dict()["binds"] == {"kind": "sandbox", "rule": "deletes", "identity": "agent",
                                    "sandbox": "sb-1", "headers_sha256": "a" * 64,
                                    "until": 1062}
    g = grant_for(b)
    assert g is not None and g.headers_sha256 == "a" * 64 and g.as_dict()["headers_sha256"]


def test_a_stored_approval_without_headers_matches_no_request():
    doc = approval().as_dict()
    for k in ("headers_sha256", "headers", "headers_injected", "binds"):
        del doc[k]
    old = Approval.from_dict(doc)
    assert old.headers_sha256 == "" and old.headers == ()


# --------------------------------------------------------------------------- the service

def ask(headers: Fields, sandbox: str | None = "sb-1", body: bytes = b"{}") -> Request:
    fields = H.bound_fields(headers)
    return Request("agent", sandbox, "POST", "https://x.example.com/a",
                   "https://x.example.com/a", "x.example.com", None,
                   hashlib.sha256(body).hexdigest(), len(body), H.digest(fields, False),
                   H.shown(fields, str), ())


APPROVED: Fields = [(b"content-type", b"application/json"), (b"x-target-env", b"staging")]
CHANGED: list[tuple[str, Fields]] = [
    ("method override", [*APPROVED, (b"X-HTTP-Method-Override", b"DELETE")]),
    ("content type", [(b"content-type", b"text/plain"), (b"x-target-env", b"staging")]),
    ("target env", [(b"content-type", b"application/json"), (b"x-target-env", b"production")]),
    ("extra header", [*APPROVED, (b"x-extra", b"1")]),
]


@pytest.mark.parametrize(("what", "changed"), CHANGED)
async def test_async_retry_with_other_headers_is_a_new_approval(tmp_path, what, changed):
    svc = Approvals(MemoryStore())
    p, r = ask_rule(tmp_path, "{mode: async, timeout: 1h}")
    with pytest.raises(ApprovalRefused) as e:
        await svc.ask(p, r, ask(APPROVED), "why")
    aid = e.value.approval
    assert aid is not None
    await svc.decide(aid, "alice", "approve", None, None)
    with pytest.raises(ApprovalRefused) as other:
        await svc.ask(p, r, ask(changed), "why")
    assert other.value.code == Code.APPROVAL_PENDING and other.value.approval != aid, what
    new = await svc.get(other.value.approval or "")
    assert new is not None and new.headers == H.shown(H.bound_fields(changed), str)
    # the approved one is still there for the identical request (name case and order aside)
    same = [(b"X-Target-Env", b"staging"), (b"Content-Type", b"application/json")]
    assert "approved" in await svc.ask(p, r, ask(same), "why")
    await svc.aclose()


async def test_a_remembered_grant_binds_the_headers(tmp_path):
    svc = Approvals(MemoryStore())
    p, r = ask_rule(tmp_path, "{remember: [request, sandbox, identity], timeout: 60}")
    held = asyncio.ensure_future(svc.ask(p, r, ask(APPROVED), "why"))
    a = await pending_one(svc)
    out = await svc.decide(a.id, "alice", "approve", {"kind": "identity", "ttl": 60}, None)
    assert out.as_dict()["binds"]["headers_sha256"] == a.headers_sha256
    assert "alice" in await held
    # another body, another sandbox, the same headers: remembered
    assert "remembered" in await svc.ask(p, r, ask(APPROVED, "sb-9", b"[]"), "why")
    for what, changed in CHANGED:  # other headers: asked anew, never the grant
        held = asyncio.ensure_future(svc.ask(p, r, ask(changed), "why"))
        b = await pending_one(svc)
        assert b.id != a.id and b.headers_sha256 != a.headers_sha256, what
        await svc.decide(b.id, "alice", "deny", None, None)
        with pytest.raises(ApprovalRefused) as e:
            await held
        assert e.value.code == Code.APPROVAL_DENIED
    await svc.aclose()


async def test_a_worker_takes_the_grant_of_an_approval_with_many_headers(tmp_path):
    """`--workers`: the front copies a remembered decision to every worker as the approval's
    document, which with its headers is larger than a vote's body."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from sandgate.approvals import api as approvals_api

    many = tuple((f"x-h{i:03d}", "\u00e9" * H.MAX_SHOWN) for i in range(100))
    a = vote(vote(approval(headers=many), "alice", "approve", Scope("sandbox", 60), None,
                  1001), "bob", "approve", Scope("sandbox", 60), None, 1002)
    body = json.dumps(a.as_dict()).encode()
    assert len(body) > 16 * 1024
    store = MemoryStore()
    app = web.Application()
    approvals_api.register(app, Approvals(store), internal=True)
    async with TestClient(TestServer(app)) as client:
        r = await client.post(f"/v1/approvals/{a.id}/grant", data=body)
        assert r.status == 200, await r.text()
    assert await store.grant("deletes", "agent", "sb-1", "a" * 64, 1003) == grant_for(a)
