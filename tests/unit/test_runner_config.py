"""`--state` and its options: the URL parser, the checks, and what a log may show."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.cli import build_parser
from sandgate.cli.run import state_config
from sandgate.state import StateConfig, parse_state_url
from sandgate.state.url import StateURL

pytestmark = pytest.mark.unit

PASSWORD = "test-state-pw-not-real"


@pytest.mark.parametrize("url,expected", [
    ("redis://127.0.0.1", StateURL("127.0.0.1")),
    ("redis://redis:6380/2", StateURL("redis", 6380, 2)),
    ("rediss://cache.internal:6379/0", StateURL("cache.internal", tls=True)),
    (f"redis://:{PASSWORD}@redis/1", StateURL("redis", db=1, password=PASSWORD)),
    (f"rediss://sandgate:{PASSWORD}@r.example", StateURL("r.example", tls=True,
                                                         username="sandgate",
                                                         password=PASSWORD)),
    ("redis://[::1]:7000", StateURL("::1", 7000)),
    ("redis://user%40x:p%3Aw@h", StateURL("h", username="user@x", password="p:w")),
])
def test_urls_parse(url: str, expected: StateURL) -> None:
    assert parse_state_url(url) == expected


@pytest.mark.parametrize("url,says", [
    ("http://redis:6379", "scheme must be redis:// or rediss://"),
    ("redis.internal:6379", "scheme must be redis://"),
    ("redis://", "no host"),
    ("redis://:6379", "no host"),
    ("redis://redis:0", "outside 1-65535"),
    ("redis://redis:99999", "port"),
    ("redis://redis:abc", "port"),
    ("redis://redis/db0", "database number"),
    ("redis://redis/0?ssl_cert_reqs=none", "no ?query"),
    ("redis://re dis", "no spaces"),
    ("redis://bad_host!/0", "not a host name"),
    ("", "expected redis://"),
])
def test_bad_urls_say_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        parse_state_url(url)
    assert says in str(e.value)


def test_a_password_never_shows() -> None:
    for bad in (f"http://u:{PASSWORD}@h", f"redis://u:{PASSWORD}@h/x",
                f"redis://u:{PASSWORD}@h:0"):
        with pytest.raises(ValueError) as e:
            parse_state_url(bad)
        assert PASSWORD not in str(e.value) and "***" in str(e.value)
    u = parse_state_url(f"rediss://sandgate:{PASSWORD}@r:6380/3")
    assert u.redacted() == "rediss://sandgate:***@r:6380/3"
    assert PASSWORD not in repr(u)


@given(host=st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,10}){0,3}", fullmatch=True)
       .filter(lambda h: not h.endswith("-")),
       port=st.integers(1, 65535), db=st.integers(0, 15), tls=st.booleans(),
       password=st.none() | st.text(st.characters(codec="ascii", categories=["L", "N"]),
                                    min_size=1, max_size=20))
def test_redacted_urls_parse_back_to_the_same_place(host: str, port: int, db: int, tls: bool,
                                                    password: str | None) -> None:
    auth = f":{password}@" if password else ""
    u = parse_state_url(f"{'rediss' if tls else 'redis'}://{auth}{host}:{port}/{db}")
    assert (u.host, u.port, u.db, u.tls, u.password) == (host, port, db, tls, password)
    back = parse_state_url(u.redacted())
    assert (back.host, back.port, back.db, back.tls) == (host, port, db, tls)
    assert back.password == ("***" if password else None)  # only the mask is shown


@given(st.text(max_size=40))
def test_any_text_parses_or_says_why(text: str) -> None:
    try:
        parse_state_url(text)
    except ValueError as e:
        assert str(e).startswith("--state ")


def _args(*extra: str) -> object:
    return build_parser().parse_args(["run", "--policies", "policies", *extra])


def test_cli_builds_the_state_config(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD + "\n")
    cfg = state_config(_args("--state", "rediss://r.internal:6380/1", "--state-prefix", "sg1:",
                             "--state-timeout", "0.5", "--state-fail", "closed",
                             "--state-password-file", str(pw)))
    assert cfg is not None
    assert (cfg.url.host, cfg.url.port, cfg.url.db, cfg.url.tls) == ("r.internal", 6380, 1, True)
    assert cfg.url.password == PASSWORD and cfg.prefix == "sg1:" and cfg.timeout == 0.5
    assert cfg.fail == "closed" and cfg.key("budget", "k") == "sg1:budget:k"
    assert state_config(_args()) is None


@pytest.mark.parametrize("extra,says", [
    (["--state-password-file", "x"], "--state-password-file needs --state URL"),
    (["--state", "redis://r", "--state-timeout", "0"], "--state-timeout"),
    (["--state", "redis://r", "--state-prefix", "a b"], "--state-prefix"),
    (["--state", "redis://r", "--state-ca", "/nonexistent"], "rediss://"),
    (["--state", "rediss://r", "--state-ca", "/nonexistent"], "no such file"),
    (["--state", f"redis://:{PASSWORD}@r", "--state-password-file", "/x"], "one of them"),
    (["--state", "redis://r", "--state-password-file", "/nonexistent"], "No such file"),
])
def test_cli_state_options_are_checked(extra: list[str], says: str) -> None:
    with pytest.raises(ValueError) as e:
        state_config(_args(*extra))
    assert says in str(e.value) and PASSWORD not in str(e.value)


@pytest.mark.parametrize("spec,expected", [
    ("secret/sandgate-leases", ("secret", "sandgate-leases")),
    ("/kv/fleet/leases/", ("kv", "fleet/leases")),
])
def test_lease_kv_paths(spec: str, expected: tuple[str, str]) -> None:
    from sandgate.state.url import lease_kv

    assert lease_kv(spec) == expected
    cfg = state_config(_args("--state", "redis://r", "--state-lease-kv", spec))
    assert cfg is not None and cfg.lease_kv == spec


@pytest.mark.parametrize("spec", ["secret", "secret/", "/", "a/../b", "se cret/x"])
def test_bad_lease_kv_paths(spec: str) -> None:
    with pytest.raises(ValueError) as e:
        state_config(_args("--state", "redis://r", "--state-lease-kv", spec))
    assert "--state-lease-kv" in str(e.value)
    with pytest.raises(ValueError, match="needs --state"):
        state_config(_args("--state-lease-kv", "secret/x"))


def test_prefix_joins_keys() -> None:
    cfg = StateConfig.from_url("redis://r")
    assert cfg.key("ended", "sb-1") == "sandgate:ended:sb-1"
