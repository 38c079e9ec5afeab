"""MCP session ids bound to identity and server by a MAC (sandgate.rpc.mcpsession), and the call
layer's use of them: the upstream's id wrapped on the way out, unwrapped (or refused) on the
way in (sandgate.stages.rpccalls.response_headers / open_session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from mitmproxy.test import tutils

from sandgate.errors import BadRequest, Code, Refused
from sandgate.policy.loader import load_policy_dir
from sandgate.request import RequestInfo
from sandgate.rpc.mcpsession import MAC_CHARS, PREFIX, SessionIdError, session_key, unwrap, wrap
from sandgate.stages.flow import CallState, FlowRecord
from sandgate.stages.rpccalls import SESSION_HEADER, open_session, response_headers
from sandgate.tokens import issue_token

TOKEN_KEY = b"unit-test-token-key-not-secret!!"
KEY = session_key(TOKEN_KEY)
HOST, PORT = "mcp.example.com", 443
SID = b"3f1c0de9-fake-session-0001"

identities = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x2FF), min_size=1,
                     max_size=20)
hosts = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,30}", fullmatch=True)
ports = st.integers(1, 65535)
sids = st.binary(min_size=1, max_size=200)


@given(identities, hosts, ports, sids)
def test_wrap_unwrap_round_trip_in_visible_ascii(identity: str, host: str, port: int,
                                                 sid: bytes) -> None:
    wrapped = wrap(KEY, identity, host, port, sid)
    assert all(0x21 <= ord(c) <= 0x7E for c in wrapped)  # what the MCP transport allows
    assert wrapped.startswith(PREFIX + ".") and len(wrapped.rsplit(".", 1)[1]) == MAC_CHARS
    assert unwrap(KEY, identity, host, port, wrapped) == sid


@given(identities, hosts, ports, identities, hosts, ports, sids)
def test_an_id_of_one_identity_and_server_never_verifies_for_another(
        id1: str, host1: str, port1: int, id2: str, host2: str, port2: int, sid: bytes) -> None:
    assume((id1, host1, port1) != (id2, host2, port2))
    wrapped = wrap(KEY, id1, host1, port1, sid)
    with pytest.raises(SessionIdError) as e:
        unwrap(KEY, id2, host2, port2, wrapped)
    assert "not issued through Sandgate" in str(e.value)
    assert wrapped not in str(e.value)  # never echoed


def test_the_binding_covers_identity_host_port_sid_and_key() -> None:
    wrapped = wrap(KEY, "agent", HOST, PORT, SID)
    for identity, host, port in (("bash-tool", HOST, PORT), ("agent", "other.example", PORT),
                                 ("agent", HOST, 8443), ("agent\0", HOST, PORT)):
        with pytest.raises((SessionIdError, ValueError)):
            unwrap(KEY, identity, host, port, wrapped)
    other_sid = wrap(KEY, "agent", HOST, PORT, b"another-fake-session")
    spliced = ".".join([*other_sid.split(".")[:2], wrapped.split(".")[2]])
    with pytest.raises(SessionIdError):  # another SID under this binding's MAC
        unwrap(KEY, "agent", HOST, PORT, spliced)
    with pytest.raises(SessionIdError):  # another proxy's key (another confdir)
        unwrap(session_key(b"another-token-key-not-secret!!!!"), "agent", HOST, PORT, wrapped)


def test_the_session_key_is_its_own_derivation_of_the_token_key() -> None:
    assert KEY != TOKEN_KEY and len(KEY) == 32
    assert session_key(TOKEN_KEY) == KEY  # every worker and replica derives the same
    assert session_key(b"x" * 32) != KEY
    with pytest.raises(ValueError):
        session_key(b"short")
    # a token's signature is never a session MAC: the token's text does not verify as an id
    token = issue_token(TOKEN_KEY, "agent")
    with pytest.raises(SessionIdError):
        unwrap(KEY, "agent", HOST, PORT, token)


GOOD = wrap(KEY, "agent", HOST, PORT, SID)
_, GOOD_BODY, GOOD_MAC = GOOD.split(".")


@pytest.mark.parametrize("value", [
    "", " ", SID.decode(), "sgs1", "sgs1.", "sgs1..", f"sgs1.{GOOD_BODY}",
    f"sg1.{GOOD_BODY}.{GOOD_MAC}", f"SGS1.{GOOD_BODY}.{GOOD_MAC}",
    f"sgs1.{GOOD_BODY}.{GOOD_MAC}.x", f"sgs1.{GOOD_BODY}.{GOOD_MAC[:-1]}",
    f"sgs1.{GOOD_BODY}.{GOOD_MAC}A", f"sgs1.{GOOD_BODY}=.{GOOD_MAC}",
    f"sgs1.{GOOD_BODY}+.{GOOD_MAC}", f"sgs1..{GOOD_MAC}", f"sgs1.A.{GOOD_MAC}",
    f"sgs1.{GOOD_BODY}.{GOOD_MAC[:-1]}!", f"sgs1.{GOOD_BODY}.{GOOD_MAC[:-1]}é",
    "sgs1." + "A" * 5000 + "." + GOOD_MAC,
], ids=lambda v: repr(v[:24]))
def test_malformed_ids_are_refused(value: str) -> None:
    with pytest.raises(SessionIdError) as e:
        unwrap(KEY, "agent", HOST, PORT, value)
    assert GOOD_BODY not in str(e.value) and SID.decode() not in str(e.value)


def test_another_spelling_of_the_same_sid_is_refused() -> None:
    sid = b"ab"  # 2 bytes: 3 base64url characters, the last with 2 unused low bits
    wrapped = wrap(KEY, "agent", HOST, PORT, sid)
    _, body, mac = wrapped.split(".")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twin = body[:-1] + alphabet[alphabet.index(body[-1]) + 1]  # decodes to the same bytes
    with pytest.raises(SessionIdError):
        unwrap(KEY, "agent", HOST, PORT, f"{PREFIX}.{twin}.{mac}")


@given(st.text(max_size=300))
def test_no_text_but_an_issued_id_unwraps(text: str) -> None:
    assume(text.strip() != GOOD)
    with pytest.raises(SessionIdError):
        unwrap(KEY, "agent", HOST, PORT, text)


# --- the call layer: wrapped on the way out, unwrapped or refused on the way in -------------

INFO = RequestInfo("https", HOST, PORT, "POST", "/mcp")
RAW_SID = b"fake-\xffsession"  # not even UTF-8: the bytes survive the round trip


def _rec(tmp_path: Path, identity: str) -> FlowRecord:
    (tmp_path / "p.yaml").write_text("version: v1\nidentities:\n  agent: {rules: []}\n")
    rec = FlowRecord()
    rec.call = CallState(load_policy_dir(tmp_path), identity, INFO)
    return rec


def _issued(tmp_path: Path, identity: str) -> str:
    resp = tutils.tresp()
    resp.headers.fields = ((b"mcp-session-id", RAW_SID),)
    response_headers(_rec(tmp_path, identity), resp, KEY)
    values = resp.headers.get_all(SESSION_HEADER)
    assert len(values) == 1 and RAW_SID not in values[0].encode("utf-8", "surrogateescape")
    return values[0]


@pytest.mark.parametrize("method", ["POST", "GET", "DELETE"])
def test_the_upstream_id_goes_out_wrapped_and_comes_back_unwrapped(tmp_path: Path,
                                                                   method: str) -> None:
    issued = _issued(tmp_path, "agent")
    req = tutils.treq(method=method.encode())
    req.headers[SESSION_HEADER] = issued
    open_session(req, KEY, "agent", INFO)
    assert [v for k, v in req.headers.fields if k.lower() == b"mcp-session-id"] == [RAW_SID]


def test_another_identitys_id_is_refused_and_not_forwarded(tmp_path: Path) -> None:
    issued = _issued(tmp_path, "agent")
    req = tutils.treq()
    req.headers[SESSION_HEADER] = issued
    with pytest.raises(Refused) as e:
        open_session(req, KEY, "bash-tool", INFO)
    assert e.value.code == Code.SESSION_MISMATCH
    assert "not issued through Sandgate to bash-tool" in e.value.reason
    assert e.value.hint and "initialize without Mcp-Session-Id" in e.value.hint
    assert issued not in e.value.reason


@pytest.mark.parametrize("value", [RAW_SID.decode("utf-8", "surrogateescape"), "anything"])
def test_an_id_sandgate_did_not_issue_is_refused(value: str) -> None:
    req = tutils.treq()
    req.headers[SESSION_HEADER] = value
    with pytest.raises(Refused) as e:
        open_session(req, KEY, "agent", INFO)
    assert e.value.code == Code.SESSION_MISMATCH and "Sandgate issued" in e.value.reason


def test_two_session_headers_are_refused(tmp_path: Path) -> None:
    issued = _issued(tmp_path, "agent")
    req = tutils.treq()
    req.headers.fields = ((b"mcp-session-id", issued.encode()),
                          (b"Mcp-Session-Id", issued.encode()))
    with pytest.raises(BadRequest) as e:
        open_session(req, KEY, "agent", INFO)
    assert e.value.code == Code.BAD_REQUEST


def test_an_empty_upstream_id_is_an_upstream_error(tmp_path: Path) -> None:
    resp = tutils.tresp()
    resp.headers.fields = ((b"mcp-session-id", b""),)
    with pytest.raises(Refused) as e:
        response_headers(_rec(tmp_path, "agent"), resp, KEY)
    assert e.value.code == Code.UPSTREAM_ERROR


def test_without_a_session_header_nothing_changes(tmp_path: Path) -> None:
    req = tutils.treq()
    before = req.headers.fields
    open_session(req, KEY, "agent", INFO)
    assert req.headers.fields == before
    resp = tutils.tresp()
    before = resp.headers.fields
    response_headers(_rec(tmp_path, "agent"), resp, KEY)
    assert resp.headers.fields == before
