"""Base-URL gateway mode: the `gateways:` section, routing a gateway path to the upstream
request, reading the token from the token header, and the gateway listener's mode."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy.http import Headers
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from sandgate.addons.pinned import Pinned, gateway_mode, pinned
from sandgate.decision import decide
from sandgate.errors import BadRequest, Code, IdentityError
from sandgate.gateway import gateway_url, route, take_token
from sandgate.identity.cidr import parse_cidr_map
from sandgate.identity.resolve import Identifier
from sandgate.policy.loader import PolicyError, load_policy_dir, load_policy_files
from sandgate.policy.model import Gateway, Source
from sandgate.refusal import Refusal
from sandgate.request import parse_url
from sandgate.tokens import issue_token
from tests.support.cli import run_cli

pytestmark = pytest.mark.unit

KEY = b"k" * 32
SRC = Source("t.yaml", 1)
ANTHROPIC = Gateway("/anthropic", "api.anthropic.com", 443, ("x-api-key", "authorization"), SRC)
OPENAI = Gateway("/openai", "api.openai.com", 443, ("authorization",), SRC)
NESTED = Gateway("/v2/llm", "llm.example.com", 8443, ("api-key",), SRC)
GATEWAYS = (ANTHROPIC, OPENAI, NESTED)

POLICY = """\
version: v1
secrets:
  anthropic: {vault: secret/data/llm/anthropic, field: api_key}
gateways:
  - {prefix: /anthropic, upstream: "https://API.Anthropic.com", token_header: X-Api-Key}
  - {prefix: /v2/llm, upstream: "https://llm.example.com:8443/", token_header: [api-key]}
identities:
  agent:
    rules:
      - name: llm
        hosts: [api.anthropic.com]
        methods: [POST]
        paths: [/v1/messages]
        inject: {headers: {x-api-key: "{{ secrets.anthropic }}"}}
"""


def _load(tmp_path: Path, *texts: str):
    paths = []
    for i, text in enumerate(texts):
        p = tmp_path / f"f{i}.yaml"
        p.write_text(text)
        paths.append(p)
    return load_policy_files(paths)


# ------------------------------------------------------------------ policy section


def test_gateways_compile(tmp_path):
    policy = _load(tmp_path, POLICY)
    assert policy.gateways == (
        Gateway("/anthropic", "api.anthropic.com", 443, ("x-api-key",), policy.gateways[0].source),
        Gateway("/v2/llm", "llm.example.com", 8443, ("api-key",), policy.gateways[1].source),
    )
    assert str(policy.gateways[0].source).endswith("f0.yaml:5")
    assert policy.gateways[0].upstream == "https://api.anthropic.com"
    assert policy.gateways[1].upstream == "https://llm.example.com:8443"


def _gw(entry: str) -> str:
    return f"version: v1\ngateways:\n  - {entry}\n"


BROKEN = [
    ("{prefix: anthropic, upstream: 'https://a.example', token_header: x-api-key}",
     "gateways[0].prefix", "does not start with '/'"),
    ("{prefix: /, upstream: 'https://a.example', token_header: x-api-key}",
     "gateways[0].prefix", "every path"),
    ("{prefix: /a/, upstream: 'https://a.example', token_header: x-api-key}",
     "gateways[0].prefix", "ends with '/'"),
    ("{prefix: /a/../b, upstream: 'https://a.example', token_header: x-api-key}",
     "gateways[0].prefix", "not plain"),
    ("{prefix: '/a%2Fb', upstream: 'https://a.example', token_header: x-api-key}",
     "gateways[0].prefix", "not plain"),
    ("{prefix: /a//b, upstream: 'https://a.example', token_header: x-api-key}",
     "gateways[0].prefix", "not plain"),
    ("{prefix: '/a\\\\b', upstream: 'https://a.example', token_header: x-api-key}",
     "gateways[0].prefix", "not plain"),
    ("{prefix: /a, upstream: 'http://a.example', token_header: x-api-key}",
     "gateways[0].upstream", "not https://"),
    ("{prefix: /a, upstream: 'a.example', token_header: x-api-key}",
     "gateways[0].upstream", "not https://"),
    ("{prefix: /a, upstream: 'https://', token_header: x-api-key}",
     "gateways[0].upstream", "no host"),
    ("{prefix: /a, upstream: 'https://a.example/v1', token_header: x-api-key}",
     "gateways[0].upstream", "has a path"),
    ("{prefix: /a, upstream: 'https://a.example?x=1', token_header: x-api-key}",
     "gateways[0].upstream", "has a path"),
    ("{prefix: /a, upstream: 'https://u:p@a.example', token_header: x-api-key}",
     "gateways[0].upstream", "userinfo"),
    ("{prefix: /a, upstream: 'https://a.example:0', token_header: x-api-key}",
     "gateways[0].upstream", "port"),
    ("{prefix: /a, upstream: 'https://a.exa mple', token_header: x-api-key}",
     "gateways[0].upstream", "whitespace"),
    ("{prefix: /a, upstream: 'https://a.example', token_header: 'x api key'}",
     "gateways[0].token_header", "not a header name"),
    ("{prefix: /a, upstream: 'https://a.example', token_header: host}",
     "gateways[0].token_header", "cannot carry the token"),
    ("{prefix: /a, upstream: 'https://a.example', token_header: Proxy-Authorization}",
     "gateways[0].token_header", "cannot carry the token"),
    ("{prefix: /a, upstream: 'https://a.example', token_header: x-sandgate-token}",
     "gateways[0].token_header", "cannot carry the token"),
    ("{prefix: /a, upstream: 'https://a.example', token_header: []}",
     "gateways[0].token_header", "empty list"),
    ("{prefix: /a, upstream: 'https://a.example', token_header: [api-key, Api-Key]}",
     "gateways[0].token_header[1]", "listed twice"),
    ("{prefix: /a, upstream: 'https://a.example'}",
     "gateways[0].token_header", ""),
    ("{prefix: /a, upstream: 'https://a.example', token_header: x-api-key, path: /v1}",
     "gateways[0].path", "unknown key"),
]


@pytest.mark.parametrize(("entry", "field", "fragment"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_gateway_entries(tmp_path, entry, field, fragment):
    with pytest.raises(PolicyError) as ei:
        _load(tmp_path, _gw(entry))
    problems = ei.value.problems
    assert any(p.field == field and fragment in p.message for p in problems), \
        [str(p) for p in problems]
    assert all(p.line == 3 for p in problems if p.field.startswith("gateways[0]"))


@pytest.mark.parametrize(("a", "b"), [("/a", "/a"), ("/a", "/a/b"), ("/a/b/c", "/a/b")])
def test_overlapping_prefixes_across_files(tmp_path, a, b):
    first = _gw(f"{{prefix: {a}, upstream: 'https://a.example', token_header: x-api-key}}")
    second = _gw(f"{{prefix: {b}, upstream: 'https://b.example', token_header: x-api-key}}")
    with pytest.raises(PolicyError) as ei:
        _load(tmp_path, first, second)
    [p] = ei.value.problems
    assert p.file.endswith("f1.yaml") and p.field == "gateways[0].prefix"
    assert "f0.yaml:3" in p.message


def test_sibling_prefixes_do_not_overlap(tmp_path):
    policy = _load(tmp_path, "version: v1\ngateways:\n"
                   "  - {prefix: /a, upstream: 'https://a.example', token_header: x-api-key}\n"
                   "  - {prefix: /ab, upstream: 'https://b.example', token_header: x-api-key}\n"
                   "  - {prefix: /b/a, upstream: 'https://c.example', token_header: x-api-key}\n")
    assert [g.prefix for g in policy.gateways] == ["/a", "/ab", "/b/a"]


# ------------------------------------------------------------------ routing

ROUTES = [
    ("/anthropic/v1/messages", ANTHROPIC, "/v1/messages", "https://api.anthropic.com:443/v1/messages"),
    ("/anthropic", ANTHROPIC, "/", "https://api.anthropic.com:443/"),
    ("/anthropic/", ANTHROPIC, "/", "https://api.anthropic.com:443/"),
    ("/anthropic?beta=1", ANTHROPIC, "/?beta=1", "https://api.anthropic.com:443/"),
    ("/anthropic/v1/messages?beta=true", ANTHROPIC, "/v1/messages?beta=true",
     "https://api.anthropic.com:443/v1/messages"),
    ("/anthropic/../openai/v1/x", ANTHROPIC, "/../openai/v1/x",
     "https://api.anthropic.com:443/../openai/v1/x"),
    ("/openai/v1/chat/completions", OPENAI, "/v1/chat/completions",
     "https://api.openai.com:443/v1/chat/completions"),
    ("/v2/llm/x", NESTED, "/x", "https://llm.example.com:8443/x"),
]


@pytest.mark.parametrize(("target", "gw", "path", "judged"), ROUTES, ids=[r[0] for r in ROUTES])
def test_route(target, gw, path, judged):
    r = route(GATEWAYS, "post", target)
    assert (r.gateway, r.path, r.info.target, r.info.method) == (gw, path, judged, "POST")


def test_route_query_is_parsed_as_the_proxy_parses_it():
    assert route(GATEWAYS, "GET", "/anthropic/x?a=1&b=%41").info.query == (("a", "1"), ("b", "A"))


NO_GATEWAY = ["/anthropicx", "/anthropicx/v1", "/Anthropic/v1", "/anthropic%2Fv1",
              "/anthropic%2F..%2Fopenai/v1", "//anthropic/v1", "/v2", "/v2/llmx", "/", "/v1/x",
              "/%61nthropic/v1", "/anthropic\\v1", "/anthropic;x/v1", "/anthropic.", ""]


@pytest.mark.parametrize("target", NO_GATEWAY)
def test_no_gateway(target):
    with pytest.raises(BadRequest) as ei:
        route(GATEWAYS, "GET", target or "/nothing")
    assert ei.value.code is Code.NO_GATEWAY
    assert "/anthropic, /openai, /v2/llm" in (ei.value.hint or "")


@pytest.mark.parametrize("target", ["https://api.openai.com/v1/x", "*", "anthropic/v1"])
def test_origin_form_only(target):
    with pytest.raises(BadRequest) as ei:
        route(GATEWAYS, "GET", target)
    assert ei.value.code is Code.BAD_REQUEST


_PATH_CHARS = string.ascii_letters + string.digits + "/.%-_~?&=;\\:@"


@given(st.text(alphabet=_PATH_CHARS, max_size=40))
def test_route_only_ever_picks_a_literal_whole_segment_prefix(tail):
    target = "/" + tail
    try:
        r = route(GATEWAYS, "GET", target)
    except BadRequest as e:
        assert e.code in (Code.NO_GATEWAY, Code.BAD_REQUEST)
        path = target.partition("?")[0]
        assert not any(path == g.prefix or path.startswith(g.prefix + "/") for g in GATEWAYS)
        return
    path = target.partition("?")[0]
    assert path == r.gateway.prefix or path.startswith(r.gateway.prefix + "/")
    assert (r.info.scheme, r.info.host, r.info.port) == ("https", r.gateway.host, r.gateway.port)
    # the upstream request is the target minus the prefix, nothing added or lost
    assert r.gateway.prefix + r.path in (target, target.replace("?", "/?", 1), target + "/")


def test_decision_on_a_gateway_request_is_the_proxys(tmp_path):
    """The gateway's request is judged by decide() exactly as the proxied URL would be."""
    (tmp_path / "p.yaml").write_text(POLICY)
    policy = load_policy_dir(tmp_path)
    for target, url in [("/anthropic/v1/messages", "https://api.anthropic.com/v1/messages"),
                        ("/anthropic/v1/admin", "https://api.anthropic.com/v1/admin"),
                        ("/anthropic/v1/x/../messages",
                         "https://api.anthropic.com/v1/x/../messages")]:
        via_gateway = decide(policy, "agent", route(policy.gateways, "POST", target).info)
        proxied = decide(policy, "agent", parse_url("POST", url))
        assert (via_gateway.allowed, via_gateway.rule_name, via_gateway.code) == (
            proxied.allowed, proxied.rule_name, proxied.code), target
    assert gateway_url(policy.gateways, "POST", "/v2/llm/a?b=c") == (
        "https://llm.example.com:8443/a?b=c", policy.gateways[1])


# ------------------------------------------------------------------ the token header


def _headers(*pairs: tuple[str, str]) -> Headers:
    return Headers([(k.encode(), v.encode()) for k, v in pairs])


TOKEN = issue_token(KEY, "agent")


@pytest.mark.parametrize(("gw", "name", "value"), [
    (ANTHROPIC, "X-Api-Key", TOKEN),
    (ANTHROPIC, "authorization", f"Bearer {TOKEN}"),
    (OPENAI, "Authorization", f"Bearer {TOKEN}"),
    (OPENAI, "authorization", f"bearer  {TOKEN} "),
    (OPENAI, "authorization", TOKEN),
    (NESTED, "api-key", TOKEN),
])
def test_take_token_reads_and_removes(gw, name, value):
    h = _headers((name, value), ("x-other", "1"))
    assert take_token(h, gw, address_known=False) == TOKEN
    assert name not in h and h["x-other"] == "1"
    caller = Identifier(KEY).identify_token(TOKEN, "10.0.0.1")
    assert (caller.identity, caller.source) == ("agent", "token")


@pytest.mark.parametrize(("gw", "pairs", "code"), [
    (ANTHROPIC, [], Code.AUTH_REQUIRED),
    (OPENAI, [("x-api-key", TOKEN)], Code.AUTH_REQUIRED),  # not OpenAI's token header
    (OPENAI, [("proxy-authorization", "Basic eDp5")], Code.AUTH_REQUIRED),
    (ANTHROPIC, [("x-api-key", "sk-ant-whatever")], Code.AUTH_INVALID),
    (OPENAI, [("authorization", "Basic " + TOKEN)], Code.AUTH_INVALID),
    (ANTHROPIC, [("x-api-key", TOKEN), ("x-api-key", TOKEN)], Code.AUTH_INVALID),
    (ANTHROPIC, [("x-api-key", TOKEN), ("authorization", f"Bearer {TOKEN}")], Code.AUTH_INVALID),
])
def test_take_token_refusals(gw, pairs, code):
    h = _headers(*pairs)
    with pytest.raises(IdentityError) as ei:
        take_token(h, gw, address_known=False)
    assert ei.value.code is code
    assert TOKEN not in str(ei.value) and "sk-ant-whatever" not in str(ei.value)


def test_one_token_header_with_a_token_the_other_with_a_key():
    """Exactly one listed header carries the token; another value stays for the rules."""
    h = _headers(("x-api-key", "sandgate-placeholder-anthropic"), ("authorization", TOKEN))
    assert take_token(h, ANTHROPIC, address_known=False) == TOKEN
    assert h["x-api-key"] == "sandgate-placeholder-anthropic" and "authorization" not in h


def test_address_identity_needs_no_token_and_keeps_a_placeholder():
    h = _headers(("x-api-key", "sandgate-placeholder-anthropic"))
    assert take_token(h, ANTHROPIC, address_known=True) is None
    assert h["x-api-key"] == "sandgate-placeholder-anthropic"
    ident = Identifier(KEY, (parse_cidr_map(["10.0.0.0/8=agent"]),))
    assert ident.address_known("10.1.2.3") and not ident.address_known("192.0.2.1")
    assert ident.identify_token(None, "10.1.2.3").source == "cidr"
    assert ident.identify_token(TOKEN, "10.1.2.3").identity == "agent"
    with pytest.raises(IdentityError) as ei:
        ident.identify_token(issue_token(KEY, "other"), "10.1.2.3")
    assert ei.value.code is Code.AUTH_INVALID
    # elsewhere a valid token identifies its client; a bad one, or none, is refused
    assert ident.identify_token(TOKEN, "192.0.2.1").source == "token"
    with pytest.raises(IdentityError):
        ident.identify_token(None, "192.0.2.1")
    with pytest.raises(IdentityError):
        ident.identify_token(issue_token(b"z" * 32, "agent"), "192.0.2.1")
    only = Identifier(KEY, (parse_cidr_map(["10.0.0.0/8=agent"], exclusive=True),))
    with pytest.raises(IdentityError):
        only.identify_token(TOKEN, "192.0.2.1")


@pytest.mark.parametrize("token", ["sg1.x.y", issue_token(b"z" * 32, "agent"),
                                   issue_token(KEY, "agent", ttl_seconds=1, now=0)])
def test_bad_bare_tokens(token):
    with pytest.raises(IdentityError) as ei:
        Identifier(KEY).identify_token(token, "10.0.0.1")
    assert ei.value.code is Code.AUTH_INVALID and token not in str(ei.value)


# ------------------------------------------------------------------ answers and the listener


def test_gateway_auth_refusal_is_401_elsewhere_407():
    for code in (Code.AUTH_REQUIRED, Code.AUTH_INVALID):
        gw = Refusal(code, "r", gateway=True)
        assert gw.status == 401 and gw.headers()["WWW-Authenticate"].startswith("Bearer")
        assert b'"status": 401' in gw.body() and "Proxy-Authenticate" not in gw.headers()
        assert Refusal(code, "r").status == 407
    assert Refusal(Code.NO_RULE, "r", gateway=True).status == 403
    assert Refusal(Code.NO_GATEWAY, "r", gateway=True).status == 404


@pytest.mark.parametrize(("host", "port", "name", "address"), [
    ("127.0.16.1", 9000, None, ("gateway.sandgate.invalid", 1)),
    ("0.0.0.0", 80, "sandgate.internal", ("sandgate.internal", 1)),
    ("::1", 9000, "::1", ("::1", 1)),
])
def test_gateway_mode_is_a_reverse_listener(host, port, name, address):
    spec = ProxyMode.parse(gateway_mode(host, port, name))
    assert isinstance(spec, ReverseMode)
    assert (spec.scheme, spec.address) == ("http", address)
    assert (spec.listen_host(), spec.listen_port()) == (host, port)
    values = pinned("32m", None, gateway=gateway_mode(host, port, name))
    assert values["mode"] == ["regular", gateway_mode(host, port, name)]
    assert pinned("32m", None)["mode"] == ["regular"]
    # with --socks5 too: exactly the three configured listeners, in a fixed order
    both = pinned("32m", None, ("127.0.15.1", 1080), gateway_mode(host, port, name))["mode"]
    assert both == ["regular", "socks5@127.0.15.1:1080", gateway_mode(host, port, name)]
    Pinned(values)  # the pinned set carries it; a change is refused like any pinned option


def test_explain_gateway(tmp_path):
    (tmp_path / "p.yaml").write_text(POLICY)
    r = run_cli("explain", "--policies", str(tmp_path), "--identity", "agent", "--gateway",
                "POST", "/anthropic/v1/messages")
    assert r.returncode == 0, r.stderr
    assert '"gateway": "/anthropic"' in r.stdout
    assert '"request": "POST https://api.anthropic.com:443/v1/messages"' in r.stdout
    r = run_cli("explain", "--policies", str(tmp_path), "--identity", "agent", "--gateway",
                "POST", "/anthropicx/v1/messages")
    assert r.returncode != 0 and "no gateway serves" in r.stderr


def test_run_refuses_gateway_misuse(tmp_path):
    (tmp_path / "p.yaml").write_text(POLICY)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "p.yaml").write_text("version: v1\n")
    base = ["run", "--confdir", str(tmp_path / "conf"), "--listen", "127.0.0.1:8080"]
    cases = [
        (["--policies", str(tmp_path), "--gateway-tls-name", "x"], "needs --gateway"),
        (["--policies", str(tmp_path), "--gateway", "127.0.0.1:8080"], "proxy listener"),
        (["--policies", str(tmp_path / "none"), "--gateway", "127.0.0.1:9"], "no `gateways:`"),
        (["--policies", str(tmp_path), "--gateway", "127.0.0.1:9", "--gateway-tls-name",
          "a b"], "expected a host name"),
    ]
    for extra, fragment in cases:
        r = run_cli(*base, *extra)
        assert r.returncode != 0 and fragment in r.stderr, (extra, r.stderr)
