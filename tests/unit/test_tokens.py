"""Proxy tokens (issue, verify, Basic auth, TTLs) and the confdir holding their key and the CA."""

from __future__ import annotations

import base64
import json
import os
import stat
import threading

import pytest

from sandgate import confdir, tokens
from sandgate.errors import IdentityError
from sandgate.identity.base import Caller
from sandgate.tokens import (
    TokenClaims,
    TokenError,
    authenticate_basic,
    issue_token,
    parse_ttl,
    verify_token,
)

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
NOW = 1_700_000_000


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ------------------------------------------------------------------------------------- format


def test_format_and_payload() -> None:
    tok = issue_token(KEY, "bash-tool", "sbx-1", 900, now=NOW)
    version, payload_b64, sig_b64 = tok.split(".")
    assert version == "sg1"
    assert "=" not in tok
    payload = json.loads(base64.urlsafe_b64decode(payload_b64 + "=" * (-len(payload_b64) % 4)))
    assert payload == {"id": "bash-tool", "sbx": "sbx-1", "iat": NOW, "exp": NOW + 900}
    assert len(base64.urlsafe_b64decode(sig_b64 + "=")) == 32


def test_round_trip() -> None:
    tok = issue_token(KEY, "bash-tool", "sbx-1", 900, now=NOW)
    assert verify_token(KEY, tok, now=NOW + 10) == TokenClaims("bash-tool", "sbx-1", NOW + 900)
    tok = issue_token(KEY, "coding-agent", ttl_seconds=60, now=NOW)
    assert verify_token(KEY, tok, now=NOW) == TokenClaims("coding-agent", None, NOW + 60)


def test_stateless_any_holder_of_the_key_verifies() -> None:
    tok = issue_token(bytes(KEY), "a", None, 60, now=NOW)
    assert verify_token(bytearray(KEY), tok, now=NOW).identity == "a"  # type: ignore[arg-type]


def test_default_now_is_the_clock() -> None:
    tok = issue_token(KEY, "a", ttl_seconds=60)
    assert verify_token(KEY, tok).identity == "a"


def test_expiry() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    assert verify_token(KEY, tok, now=NOW + 59).identity == "a"
    with pytest.raises(TokenError, match="expired"):
        verify_token(KEY, tok, now=NOW + 60)
    with pytest.raises(TokenError, match="expired"):
        verify_token(KEY, tok, now=NOW + 10**6)


def test_wrong_key() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    with pytest.raises(TokenError, match="signature"):
        verify_token(OTHER_KEY, tok, now=NOW)


def _forge(payload: object, key: bytes = KEY, version: str = "sg1") -> str:
    """A correctly signed token carrying an arbitrary payload, to test the payload checks."""
    import hashlib
    import hmac

    p = b64url(json.dumps(payload).encode())
    sig = hmac.new(key, f"{version}.{p}".encode(), hashlib.sha256).digest()
    return f"{version}.{p}.{b64url(sig)}"


def test_tampered_payload_is_refused() -> None:
    tok = issue_token(KEY, "bash-tool", None, 60, now=NOW)
    _, _, sig = tok.split(".")
    evil = b64url(json.dumps({"id": "admin", "sbx": None, "iat": NOW, "exp": NOW + 60}).encode())
    with pytest.raises(TokenError, match="signature"):
        verify_token(KEY, f"sg1.{evil}.{sig}", now=NOW)


def test_tampered_signature_is_refused() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    v, p, s = tok.split(".")
    flipped = s[:-2] + ("A" if s[-2] != "A" else "B") + s[-1]
    with pytest.raises(TokenError, match="signature"):
        verify_token(KEY, f"{v}.{p}.{flipped}", now=NOW)
    with pytest.raises(TokenError, match="signature"):
        verify_token(KEY, f"{v}.{p}.", now=NOW)


@pytest.mark.parametrize("bad", [
    "", "sg1", "sg1.", "sg1..", "sg1.a.b.c", "not a token", "sg1.!!!.???", "sg1.a\u00e9.b",
    "x" * 10_000,
])
def test_malformed(bad: str) -> None:
    with pytest.raises(TokenError) as e:
        verify_token(KEY, bad, now=NOW)
    if len(bad) > 6:
        assert bad not in str(e.value)


def test_unknown_version() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    with pytest.raises(TokenError, match="version"):
        verify_token(KEY, "sg2" + tok[3:], now=NOW)
    with pytest.raises(TokenError, match="version"):
        verify_token(KEY, _forge({"id": "a", "sbx": None, "iat": NOW, "exp": NOW + 60},
                                 version="sg2"), now=NOW)


@pytest.mark.parametrize("payload, match", [
    ({"sbx": None, "iat": NOW, "exp": NOW + 60}, "missing field 'id'"),
    ({"id": "a", "sbx": None, "iat": NOW}, "missing field 'exp'"),
    ({"id": "a", "iat": NOW, "exp": NOW + 60}, "missing field 'sbx'"),
    ({"id": "a", "sbx": None, "exp": NOW + 60}, "missing field 'iat'"),
    ({"id": "", "sbx": None, "iat": NOW, "exp": NOW + 60}, "identity"),
    ({"id": 5, "sbx": None, "iat": NOW, "exp": NOW + 60}, "identity"),
    ({"id": "a", "sbx": 7, "iat": NOW, "exp": NOW + 60}, "sandbox"),
    ({"id": "a", "sbx": "", "iat": NOW, "exp": NOW + 60}, "sandbox"),
    ({"id": "a", "sbx": None, "iat": NOW, "exp": "later"}, "timestamps"),
    ({"id": "a", "sbx": None, "iat": NOW, "exp": True}, "timestamps"),
    ({"id": "a", "sbx": None, "iat": "x", "exp": NOW + 60}, "timestamps"),
    (["a"], "malformed"),
])
def test_signed_but_invalid_payload(payload: object, match: str) -> None:
    with pytest.raises(TokenError, match=match):
        verify_token(KEY, _forge(payload), now=NOW)


def test_forged_helper_makes_valid_tokens() -> None:
    tok = _forge({"id": "a", "sbx": None, "iat": NOW, "exp": NOW + 60})
    assert verify_token(KEY, tok, now=NOW) == TokenClaims("a", None, NOW + 60)


def test_error_messages_never_echo_the_token() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    _, p, s = tok.split(".")
    for bad, key, now in [(tok, OTHER_KEY, NOW), (tok, KEY, NOW + 61), ("sg2." + p + "." + s, KEY,
                                                                          NOW)]:
        with pytest.raises(TokenError) as e:
            verify_token(key, bad, now=now)
        assert p not in str(e.value) and s not in str(e.value)


@pytest.mark.parametrize("kwargs", [
    {"identity": ""}, {"sandbox": ""}, {"ttl_seconds": 0}, {"ttl_seconds": -5},
    {"ttl_seconds": 1.5}, {"ttl_seconds": True}, {"ttl_seconds": 366 * 86400},
])
def test_issue_rejects_bad_arguments(kwargs: dict) -> None:
    args = {"identity": "a", "sandbox": None, "ttl_seconds": 60} | kwargs
    with pytest.raises(ValueError):
        issue_token(KEY, **args)


def test_short_key_is_refused() -> None:
    with pytest.raises(ValueError):
        issue_token(b"short", "a", None, 60)
    with pytest.raises(ValueError):
        verify_token(b"", "sg1.a.b")


# ----------------------------------------------------------------------------------------- TTL


@pytest.mark.parametrize("text, seconds", [
    ("30s", 30), ("15m", 900), ("1h", 3600), ("7d", 604800), ("365d", 365 * 86400),
    ("90m", 5400), (" 2h ", 7200),
])
def test_parse_ttl(text: str, seconds: int) -> None:
    assert parse_ttl(text) == seconds


@pytest.mark.parametrize("text", [
    "", "0s", "1x", "-1h", "1.5h", "h", "1", "1 h", "1H", "366d", "8761h", "+1h", "1h30m",
])
def test_parse_ttl_rejects(text: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_ttl(text)
    assert "TTL" in str(e.value)


# ------------------------------------------------------------------------------ Basic auth


def test_basic_with_identity_as_user() -> None:
    tok = issue_token(KEY, "bash-tool", "sbx-1", 60, now=NOW)
    caller = authenticate_basic(basic("bash-tool", tok), KEY, now=NOW)
    assert caller == Caller("bash-tool", "sbx-1", "token")


def test_basic_with_sandbox_as_user() -> None:
    tok = issue_token(KEY, "bash-tool", "sbx-1", 60, now=NOW)
    assert authenticate_basic(basic("sbx-1", tok), KEY, now=NOW) == Caller(
        "bash-tool", "sbx-1", "token")


def test_basic_scheme_is_case_insensitive() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    value = basic("a", tok).replace("Basic", "bAsIc")
    assert authenticate_basic(value, KEY, now=NOW).identity == "a"


@pytest.mark.parametrize("value", [None, "", "   "])
def test_basic_missing(value: str | None) -> None:
    with pytest.raises(IdentityError) as e:
        authenticate_basic(value, KEY, now=NOW)
    assert e.value.code == "auth_required"


def _assert_invalid(value: str, *secrets: str, match: str = "") -> IdentityError:
    with pytest.raises(IdentityError) as e:
        authenticate_basic(value, KEY, now=NOW)
    assert e.value.code == "auth_invalid"
    assert match in str(e.value)
    for s in secrets:
        assert s not in str(e.value)
    return e.value


def test_basic_invalid_shapes() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    _assert_invalid("Bearer " + tok, tok, match="Basic")
    _assert_invalid("Basic", match="malformed")
    _assert_invalid("Basic !!notbase64!!", match="malformed")
    _assert_invalid("Basic " + base64.b64encode(b"no-colon-here").decode(), match="':'")
    _assert_invalid("Basic " + base64.b64encode(b"\xff\xfe:\xff").decode(), match="malformed")


def test_basic_bad_tokens_never_echo_the_password() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    with pytest.raises(IdentityError) as e:
        authenticate_basic(basic("a", tok), OTHER_KEY, now=NOW)
    assert e.value.code == "auth_invalid" and tok not in str(e.value)
    _assert_invalid(basic("a", "hunter2-FAKE"), "hunter2-FAKE", match="malformed")


def test_basic_expired() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW - 120)
    _assert_invalid(basic("a", tok), tok, match="expired")


def test_basic_user_mismatch() -> None:
    tok = issue_token(KEY, "bash-tool", "sbx-1", 60, now=NOW)
    err = _assert_invalid(basic("x", tok), tok)
    assert str(err) == "user 'x' does not match the token"
    _assert_invalid(basic("", tok), tok, match="does not match")


def test_basic_user_that_is_a_token_is_not_echoed() -> None:
    tok = issue_token(KEY, "bash-tool", None, 60, now=NOW)
    other = issue_token(KEY, "someone-else", None, 60, now=NOW)
    _assert_invalid(basic(tok, tok), tok, match="does not match")
    _assert_invalid(basic(other, tok), other, tok, match="does not match")
    _assert_invalid(basic(tok[:20], tok), tok[:20], match="does not match")


def test_password_may_not_contain_a_colon_but_user_split_is_first_colon() -> None:
    tok = issue_token(KEY, "a", None, 60, now=NOW)
    # "a:b:<token>" -> user "a", password "b:<token>": not a token.
    _assert_invalid(basic("a", "b:" + tok), tok)


# ----------------------------------------------------------------------------------- confdir


def test_ensure_confdir_is_private(tmp_path) -> None:
    d = confdir.ensure_confdir(tmp_path / "a" / "b")
    assert d.is_dir()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    confdir.ensure_confdir(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_token_key_created_once_private_and_stable(tmp_path) -> None:
    k1 = confdir.token_key(tmp_path)
    k2 = confdir.token_key(tmp_path)
    assert k1 == k2 and len(k1) == 32
    path = tmp_path / confdir.TOKEN_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert base64.b64decode(path.read_bytes().strip()) == k1
    assert [p.name for p in tmp_path.iterdir()] == [confdir.TOKEN_KEY_FILE]  # no temp files


def test_token_key_reads_raw_and_base64(tmp_path) -> None:
    raw = bytes(range(32))
    (tmp_path / confdir.TOKEN_KEY_FILE).write_bytes(raw)
    assert confdir.token_key(tmp_path) == raw
    (tmp_path / confdir.TOKEN_KEY_FILE).write_bytes(base64.b64encode(raw) + b"\n")
    assert confdir.token_key(tmp_path) == raw


def test_token_key_rejects_garbage(tmp_path) -> None:
    (tmp_path / confdir.TOKEN_KEY_FILE).write_bytes(b"too short")
    with pytest.raises(ValueError, match="token key"):
        confdir.token_key(tmp_path)


def test_token_key_concurrent_creators_agree(tmp_path) -> None:
    results: list[bytes] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        results.append(confdir.token_key(tmp_path))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [confdir.TOKEN_KEY_FILE]


def test_issue_with_confdir_key_verifies_elsewhere(tmp_path) -> None:
    tok = tokens.issue_token(confdir.token_key(tmp_path), "a", None, 60)
    assert tokens.verify_token(confdir.token_key(tmp_path), tok).identity == "a"


def test_ensure_ca_creates_where_mitmproxy_looks_and_returns_public_cert(tmp_path) -> None:
    from mitmproxy.certs import CertStore

    path = confdir.ensure_ca(tmp_path)
    assert path == tmp_path / "mitmproxy-ca-cert.pem"
    pem = path.read_text()
    assert pem.startswith("-----BEGIN CERTIFICATE-----")
    assert "PRIVATE KEY" not in pem
    assert (tmp_path / "mitmproxy-ca.pem").exists()
    assert stat.S_IMODE((tmp_path / "mitmproxy-ca.pem").stat().st_mode) & 0o077 == 0
    # mitmproxy loading the same confdir uses this very CA.
    store = CertStore.from_store(str(tmp_path), "mitmproxy", 2048)
    assert store.default_ca.to_pem().decode() == pem
    # Stable on the second call, and no temporary directories left behind.
    assert confdir.ensure_ca(tmp_path).read_text() == pem
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_ensure_ca_repairs_a_missing_public_cert(tmp_path) -> None:
    pem = confdir.ensure_ca(tmp_path).read_text()
    (tmp_path / "mitmproxy-ca-cert.pem").unlink()
    assert confdir.ensure_ca(tmp_path).read_text() == pem


def test_ensure_ca_concurrent_creators_agree(tmp_path) -> None:
    results: list[str] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        barrier.wait()
        results.append(confdir.ensure_ca(tmp_path).read_text())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    from mitmproxy.certs import CertStore

    store = CertStore.from_store(str(tmp_path), "mitmproxy", 2048)
    assert store.default_ca.to_pem().decode() == results[0]
