"""Limits (issue #11): bucket and budget maths, connection counting, the policy's `limits:` and
`budget:` (located load errors), the flags, the metric, and the wire-level bounds."""

from __future__ import annotations

import argparse
from pathlib import Path

import h2.config
import h2.exceptions
import h2.frame_buffer
import pytest
from hyperframe.frame import ContinuationFrame, HeadersFrame
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.proxy.layers.http import _http_h2

from sandgate.cli import build_parser, limits_config
from sandgate.errors import Code, LimitExceeded
from sandgate.limits import (
    ConnectionCounter,
    Limiter,
    LimitsConfig,
    TokenBucket,
    WindowBudget,
    retry_after,
)
from sandgate.metrics import Metrics
from sandgate.mitm.guards import wirelimits
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import IdentityLimits, Policy, SecretBudget

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------ bucket maths

def test_bucket_burst_then_one_token_per_interval():
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)  # the next token in 1/rate
    assert b.take(0.25) == pytest.approx(0.25)
    assert b.take(0.5) == 0.0
    assert b.take(10.0) == 0.0  # refilled, but never above burst
    assert b.tokens == pytest.approx(2.0)


@given(rate=st.floats(0.1, 100), burst=st.integers(1, 50),
       gaps=st.lists(st.floats(0, 2), min_size=1, max_size=200))
def test_bucket_never_grants_more_than_burst_plus_rate_times_time(rate, burst, gaps):
    b = TokenBucket(rate, burst, now=0.0)
    now, granted = 0.0, 0
    for g in gaps:
        now += g
        wait = b.take(now)
        assert wait >= 0
        if wait == 0:
            granted += 1
        else:  # the wait it names is enough
            assert b.take(now + wait + 1e-6) == 0.0
            granted += 1
            now += wait + 1e-6
    assert granted <= burst + rate * now + 1e-6


@pytest.mark.parametrize("seconds,header", [(0.0001, 1), (0.5, 1), (1.0, 1), (1.01, 2),
                                            (4.2, 5), (3600.0, 3600)])
def test_retry_after_is_whole_seconds_rounded_up(seconds, header):
    assert retry_after(seconds) == header


def test_window_budget_rolls_over():
    w = WindowBudget(calls=2, per=60)
    assert w.wait(0) == 0
    w.spend(0)
    w.spend(10)
    assert w.wait(20) == pytest.approx(40)
    assert w.wait(60) == 0  # a new window
    w.spend(60)
    assert w.used == 1


# ------------------------------------------------------------------------ the limiter

def test_rate_per_identity_with_policy_override():
    clock = Clock()
    lim = Limiter(LimitsConfig(rps=100.0), clock)
    slow = IdentityLimits(rps=1.0, burst=2)
    lim.admit("a", slow)
    lim.admit("a", slow)
    with pytest.raises(LimitExceeded) as ei:
        lim.admit("a", slow)
    assert ei.value.code is Code.RATE_LIMITED and ei.value.retry_after == 1
    assert ei.value.status == 429
    lim.admit("b", None)  # another identity: its own bucket, the flag's rate
    clock.now += 1.0
    lim.admit("a", slow)
    # a reload that changes the rate starts a full bucket at the new rate
    lim.admit("a", IdentityLimits(rps=5.0, burst=1))
    with pytest.raises(LimitExceeded):
        lim.admit("a", IdentityLimits(rps=5.0, burst=1))


def test_no_rate_by_default():
    lim = Limiter(LimitsConfig(), Clock())
    for _ in range(10_000):
        lim.admit("a", None)
    assert lim.rate(IdentityLimits(burst=3)) is None  # burst alone limits nothing


def test_budget_is_all_or_nothing_and_says_when():
    clock = Clock()
    lim = Limiter(LimitsConfig(), clock)
    small, big = SecretBudget(calls=1, per=3600), SecretBudget(calls=5, per=60)
    lim.spend([("a", small), ("b", big)])
    with pytest.raises(LimitExceeded) as ei:
        lim.spend([("b", big), ("a", small)])
    assert ei.value.code is Code.BUDGET_EXHAUSTED and ei.value.retry_after == 3600
    assert "'a'" in str(ei.value)
    # b was not spent by the refused request: 4 more fit
    for _ in range(4):
        lim.spend([("b", big)])
    with pytest.raises(LimitExceeded):
        lim.spend([("b", big)])
    clock.now += 3600
    lim.spend([("a", small), ("b", big)])
    lim.spend([("c", None)] * 100)  # no budget: never refused


def test_connections_counted_once_per_identity_and_released():
    c = ConnectionCounter()
    assert c.connected("c1", 2) and c.connected("c2", 2)
    assert not c.connected("c3", 2)  # over the total
    c.disconnected("c3")
    assert c.identify("c1", "a", 1)
    assert c.identify("c1", "a", 1)  # the same connection again: counted once
    assert not c.identify("c2", "a", 1)
    assert c.per_identity == {"a": 1}
    c.disconnected("c1")
    assert c.per_identity == {} and c.total == 1
    assert c.identify("c2", "a", 1)


def test_limiter_connection_refusal_and_policy_override():
    lim = Limiter(LimitsConfig(max_connections_per_identity=1), Clock())
    lim.identified("c1", "a", None)
    with pytest.raises(LimitExceeded) as ei:
        lim.identified("c2", "a", None)
    assert ei.value.code is Code.TOO_MANY_CONNECTIONS and ei.value.retry_after == 1
    lim.identified("c2", "a", IdentityLimits(max_connections=2))


# ------------------------------------------------------------------------ the policy format

GOOD = """\
version: v1
secrets:
  gh: {vault: secret/data/gh, field: token, budget: {calls: 1000, per: 1h}}
  n: {vault: secret/data/n, field: token, budget: {calls: 3, per: 90}}
identities:
  a:
    limits: {rps: 0.5, burst: 3, max_connections: 8}
  b:
    rules: [{name: r, hosts: [x.example]}]
"""


def test_limits_and_budgets_compile(tmp_path: Path):
    (tmp_path / "p.yaml").write_text(GOOD)
    p = load_policy_dir(tmp_path)
    assert p.identities["a"].limits == IdentityLimits(rps=0.5, burst=3, max_connections=8)
    assert p.identities["b"].limits is None
    assert p.secrets["gh"].budget == SecretBudget(calls=1000, per=3600.0)
    assert p.secrets["n"].budget == SecretBudget(calls=3, per=90.0)


# (the YAML under `a:` or under the secret, line of the problem, field, message fragment)
BROKEN_LIMITS = [
    ("limits: {rps: 0}", 6, "identities.a.limits.rps", "above 0"),
    ("limits: {rps: -2}", 6, "identities.a.limits.rps", "above 0"),
    ("limits: {rps: .inf}", 6, "identities.a.limits.rps", "above 0"),
    ("limits: {rps: fast}", 6, "identities.a.limits.rps", ""),
    ("limits: {burst: 0}", 6, "identities.a.limits.burst", "at least 1"),
    ("limits: {max_connections: 0}", 6, "identities.a.limits.max_connections", "at least 1"),
    ("limits: {max_conns: 3}", 6, "identities.a.limits.max_conns", "unknown key"),
    ("limits: 5", 6, "identities.a.limits", ""),
]
BROKEN_BUDGETS = [
    ("budget: {calls: 0, per: 1h}", 3, "secrets.s.budget.calls", "at least 1"),
    ("budget: {calls: 5, per: 1y}", 3, "secrets.s.budget.per", "invalid"),
    ("budget: {calls: 5, per: 0}", 3, "secrets.s.budget.per", "at least 1 second"),
    ("budget: {calls: 5}", 3, "secrets.s.budget.per", "per"),
    ("budget: {calls: 5, per: 1h, burst: 2}", 3, "secrets.s.budget.burst", "unknown key"),
]


def _problems(tmp_path: Path, text: str) -> list:
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    return list(ei.value.problems)


@pytest.mark.parametrize("entry,line,field,fragment", BROKEN_LIMITS)
def test_broken_limits_are_located(tmp_path, entry, line, field, fragment):
    text = ("version: v1\nsecrets: {}\nidentities:\n  a:\n    rules: []\n"
            f"    {entry}\n")
    (p,) = _problems(tmp_path, text)
    assert (p.line, p.field) == (line, field), p
    assert fragment in p.message and p.fix


@pytest.mark.parametrize("entry,line,field,fragment", BROKEN_BUDGETS)
def test_broken_budgets_are_located(tmp_path, entry, line, field, fragment):
    text = ("version: v1\nsecrets:\n  s:\n    vault: secret/data/s\n    field: f\n"
            f"    {entry}\nidentities: {{}}\n")
    # the problem is reported at the line of `budget:` or of the key inside it
    (p,) = _problems(tmp_path, text)
    assert p.field == field, p
    assert p.line in (line, 6)
    assert fragment in p.message and p.fix


def test_limits_set_in_one_file_only(tmp_path: Path):
    (tmp_path / "1.yaml").write_text("version: v1\nidentities:\n  a:\n    limits: {rps: 1}\n")
    (tmp_path / "2.yaml").write_text("version: v1\nidentities:\n  a:\n    limits: {rps: 2}\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    (p,) = ei.value.problems
    assert p.field == "identities.a.limits" and "also set" in p.message


# ------------------------------------------------------------------------ flags

def _run_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", "--policies", "p", *flags])


def test_flag_defaults():
    cfg = limits_config(_run_args())
    assert cfg == LimitsConfig()
    assert (cfg.max_header_bytes, cfg.max_headers, cfg.max_connections,
            cfg.max_connections_per_identity, cfg.rps) == (65536, 100, 4096, 256, None)


def test_flags_zero_turns_off_and_bad_values_are_refused():
    cfg = limits_config(_run_args("--max-connections", "0", "--upstream-read-timeout", "0",
                                  "--rps", "2.5", "--burst", "4"))
    assert cfg.max_connections is None and cfg.upstream_read_timeout is None
    assert (cfg.rps, cfg.burst) == (2.5, 4)
    for flags, fragment in [(("--max-headers", "2"), "--max-headers"),
                            (("--max-header-bytes", "100"), "--max-header-bytes"),
                            (("--burst", "3"), "--burst needs --rps"),
                            (("--idle-timeout", "-1"), "--idle-timeout"),
                            (("--max-connections-per-identity", "-5"), "per-identity")]:
        with pytest.raises(ValueError, match=fragment):
            limits_config(_run_args(*flags))


# ------------------------------------------------------------------------ metric

def test_limit_refusals_are_counted_by_code():
    m = Metrics(lambda: Policy(identities={}, secrets={}))
    m.on_audit("request", {"code": "rate_limited", "decision": "deny"})
    m.on_audit("connect", {"code": "headers_too_large", "decision": "deny"})
    m.on_audit("limit", {"code": "idle_timeout"})
    m.on_audit("request", {"code": "upstream_timeout", "decision": "deny"})
    m.on_audit("request", {"code": "no_rule", "decision": "deny"})  # not a limit
    text = m.render().decode()
    for code in ("rate_limited", "headers_too_large", "idle_timeout", "upstream_timeout"):
        assert f'sandgate_limit_refusals_total{{code="{code}"}} 1.0' in text
    assert 'sandgate_limit_refusals_total{code="no_rule"}' not in text


# ------------------------------------------------------------------------ wire-level bounds

@pytest.fixture
def wired():
    wirelimits.install(LimitsConfig(max_header_bytes=2048, max_headers=20))
    yield
    wirelimits.install(LimitsConfig())


def test_wire_patches_are_in_place(wired):
    wirelimits.install(LimitsConfig(max_header_bytes=2048, max_headers=20))  # idempotent
    assert wirelimits.installed()


def test_head_over_the_limit_is_detected_without_an_end():
    assert not wirelimits._head_over(bytearray(b"GET / HTTP/1.1\r\n" + b"x" * 10), 64)
    assert wirelimits._head_over(bytearray(b"GET / HTTP/1.1\r\nX: " + b"x" * 100), 64)
    # a head that ended within the limit, followed by a body, is not over
    assert not wirelimits._head_over(bytearray(b"GET / HTTP/1.1\r\n\r\n" + b"b" * 100), 64)


def test_head_bytes_counts_as_http1_would():
    req = http.Request.make("GET", "https://h.example/abc")
    req.headers = http.Headers(a="bb")
    # "GET /abc HTTP/1.1\r\n" + "a: bb\r\n" + "\r\n"
    assert wirelimits.head_bytes(req) == len(b"GET /abc HTTP/1.1\r\n") + len(b"a: bb\r\n") + 2


def test_h2_header_list_bounded_on_client_connections(wired):
    """Past max_header_bytes (2048 here) the hooks answer 431 on the stream; h2 itself decodes
    up to the readable bound (512 KiB at least) and ends the connection only past it."""
    readable = wirelimits.h2_readable_head(wirelimits._state.limits)
    assert readable == wirelimits.H2_READABLE_HEAD
    conn = _http_h2.BufferedH2Connection(h2.config.H2Configuration(client_side=False))
    assert conn.decoder.max_header_list_size == readable + 32 * 28
    upstream = _http_h2.BufferedH2Connection(h2.config.H2Configuration(client_side=True))
    assert upstream.decoder.max_header_list_size == 2 ** 16  # h2's own, for responses
    # an encoded header block past the bound is refused while it is being collected
    fb = conn.incoming_buffer
    start = HeadersFrame(1, data=b"x" * (readable - 1000))
    assert fb._update_header_buffer(start) is None
    with pytest.raises(h2.exceptions.DenialOfServiceError):
        fb._update_header_buffer(ContinuationFrame(1, data=b"y" * 3000))
