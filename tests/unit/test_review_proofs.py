"""Exact policy proofs: `narrower_than` and secret `hosts:` (sandgate.review.proofs).

Planted counter-examples are refuted with the request printed; the shipped policy proves; and
for many random policies the proof agrees with decide() / decide_connect() on every request of
a brute-force grid.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from sandgate.cli import main as cli_main
from sandgate.decision import decide_connect, decide_request
from sandgate.policy.compiler import compile_identity
from sandgate.policy.hosts import compile_host_pattern, normalise_host
from sandgate.policy.loader import PolicyError, load_policy_dir
from sandgate.policy.model import AskPolicy, Identity, Policy, SecretRef, Source
from sandgate.policy.paths import compile_path_pattern, normalise_path
from sandgate.request import RequestInfo, parse_query, parse_url
from sandgate.review.proofs import (
    NORMALISED_PATH_REGEX,
    ProofResult,
    cidrs_covered,
    find_path,
    glob_nfa,
    glob_regex,
    host_witnesses,
    is_normalised_path,
    prove,
    prove_narrower,
    prove_secret_hosts,
    raw_path,
)
from tests.unit.fuzz import examples

ROOT = Path(__file__).parents[2]

HEAD = """version: v1
secrets:
  tok: {vault: secret/data/tok, field: v}
  tok2: {vault: secret/data/tok2, field: v}
identities:
"""


def load(tmp_path: Path, identities: str, head: str = HEAD) -> Policy:
    (tmp_path / "p.yaml").write_text(head + identities)
    return load_policy_dir(tmp_path)


def narrower(tmp_path: Path, narrow_rules: str, other_rules: str) -> ProofResult:
    pol = load(tmp_path, f"""  n:
    narrower_than: o
    rules:
{narrow_rules}
  o:
    rules:
{other_rules}
""")
    [res] = prove(pol)
    assert res.kind == "narrower_than" and res.claim == "n narrower than o"
    if not res.ok:
        check_counterexample(pol, "n", "o", res)
    return res


def check_counterexample(pol: Policy, narrow: str, other: str, res: ProofResult) -> None:
    """Independently of the prover: the printed request is judged as the proof claims."""
    assert res.counterexample is not None
    method, target = res.counterexample.split(" ", 1)
    if method == "CONNECT":
        host, _, port = target.rpartition(":")
        dn = decide_connect(pol, narrow, host.strip("[]"), int(port))
        do = decide_connect(pol, other, host.strip("[]"), int(port))
        assert dn.allowed and dn.rule is not None and dn.rule.passthrough
        assert not (do.allowed and do.rule is not None and do.rule.passthrough
                    and cidrs_covered(dn.rule.private_cidrs, do.rule.private_cidrs))
        return
    req = parse_url(method, target)
    assert re.fullmatch(r"https?://[^/]+:\d+/.*", target), target  # the port is always shown
    dn = decide_request(pol, narrow, req)  # the proxy's verdict: the tunnel first
    do = decide_request(pol, other, req)
    assert dn.allowed and dn.rule is not None, dn.reason
    assert f"rule '{dn.rule.name}'" in str(res)
    if do.allowed:
        assert do.rule is not None
        assert not (dn.rule.secrets <= do.rule.secrets
                    and cidrs_covered(dn.rule.private_cidrs, do.rule.private_cidrs)
                    and limit_ok(dn.rule.max_request_bytes, do.rule.max_request_bytes)
                    and gate_ok(dn.rule.ask, do.rule.ask))
    else:
        assert do.reason in str(res)


def limit_ok(narrow: int | None, other: int | None) -> bool:
    """Every body size the narrow rule lets through, the other rule does."""
    return other is None or (narrow is not None and narrow <= other)


# --- the shipped policy -----------------------------------------------------------------------


def test_shipped_policy_proves():
    pol = load_policy_dir(ROOT / "policies")
    results = prove(pol)
    assert [str(r) for r in results] == [
        "proof ok: bash-tool narrower than coding-agent",
        "proof ok: secret anthropic only to api.anthropic.com",
        "proof ok: secret openai only to api.openai.com",
    ]
    # ...and the other directions are refuted, each with a counter-example decide() confirms.
    for a in pol.identities:
        for b in pol.identities:
            res = prove_narrower(pol, a, b)
            if not res.ok:
                check_counterexample(pol, a, b, res)
    assert not prove_narrower(pol, "coding-agent", "bash-tool").ok
    assert not prove_narrower(pol, "web-fetch", "bash-tool").ok
    assert not prove_narrower(pol, "bash-tool", "web-fetch").ok  # files.pythonhosted.org


def test_check_prints_proofs_and_fails_on_a_refuted_one(tmp_path, capsys):
    assert cli_main(["check", str(ROOT / "policies")]) == 0
    out = capsys.readouterr().out
    assert "proof ok: bash-tool narrower than coding-agent\n" in out
    assert "proof ok: secret anthropic only to api.anthropic.com\n" in out
    assert out.index("proof ok") < out.index("ok   ")  # proofs before fixtures

    (tmp_path / "p.yaml").write_text(HEAD + """  n:
    narrower_than: o
    rules: [{name: w, hosts: [a.example.com], methods: [POST]}]
  o:
    rules: [{name: r, hosts: [a.example.com], methods: [GET]}]
""")
    assert cli_main(["check", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "proof FAILED: n narrower than o" in out
    assert "counter-example: POST https://a.example.com:443/" in out
    assert "n allows it: allowed by rule 'w' of identity 'n'" in out
    assert "o refuses it: identity 'o' has no rule allowing POST https://a.example.com:443/" in out


# --- planted counter-examples ------------------------------------------------------------------


def test_method_post_where_other_allows_get_only(tmp_path):
    res = narrower(tmp_path, "      - {name: w, hosts: [a.example.com], methods: [GET, POST]}",
                   "      - {name: r, hosts: [a.example.com], methods: [GET]}")
    assert not res.ok
    assert res.counterexample == "POST https://a.example.com:443/"


def test_any_method_where_other_names_some(tmp_path):
    res = narrower(tmp_path, "      - {name: w, hosts: [a.example.com]}",
                   "      - {name: r, hosts: [a.example.com], methods: [GET, HEAD, POST]}")
    assert not res.ok  # the fresh method stands for every method nobody names
    assert res.counterexample is not None
    assert res.counterexample.split()[0] not in ("GET", "HEAD", "POST")


def test_double_star_where_other_allows_one_segment(tmp_path):
    res = narrower(tmp_path, "      - {name: w, hosts: [a.example.com], paths: [/v1/**]}",
                   "      - {name: r, hosts: [a.example.com], paths: [/v1/*]}")
    assert not res.ok
    assert res.counterexample == "GET https://a.example.com:443/v1"  # ** is zero segments too
    res = narrower(tmp_path,
                   "      - {name: w, hosts: [a.example.com], paths: [/v1/*/*]}",
                   "      - {name: r, hosts: [a.example.com], paths: [/v1/*, /v1/*/x]}")
    assert not res.ok
    assert res.counterexample == "GET https://a.example.com:443/v1/a/a"


def test_paths_that_are_equal_as_languages_prove(tmp_path):
    # /v1/** equals /v1 + /v1/** ; "/a*" covers "/a" and "/ab"; a trailing slash is its own path.
    assert narrower(tmp_path, "      - {name: w, hosts: [h.org], paths: [/v1, /v1/a/**, /ab]}",
                    "      - {name: r, hosts: [h.org], paths: ['/v1/**', '/a*']}").ok
    res = narrower(tmp_path, "      - {name: w, hosts: [h.org], paths: [/v1/]}",
                   "      - {name: r, hosts: [h.org], paths: [/v1, /v1/*]}")
    assert not res.ok and res.counterexample == "GET https://h.org:443/v1/"


def test_wildcard_where_other_allows_one_host(tmp_path):
    res = narrower(tmp_path, "      - {name: w, hosts: ['*.example.com']}",
                   "      - {name: r, hosts: [a.example.com, x.example.com]}")
    assert not res.ok
    assert res.counterexample == "GET https://y.example.com:443/"  # x is taken: a fresh label
    assert narrower(tmp_path, "      - {name: w, hosts: ['*.a.example.com', b.example.com]}",
                    "      - {name: r, hosts: ['*.example.com']}").ok
    res = narrower(tmp_path, "      - {name: w, hosts: [example.com]}",
                   "      - {name: r, hosts: ['*.example.com']}")
    assert not res.ok and res.counterexample == "GET https://example.com:443/"  # not the apex


def test_narrow_injects_a_secret_the_other_does_not(tmp_path):
    res = narrower(
        tmp_path,
        '      - {name: w, hosts: [api.x.com], inject: {headers: {authorization: '
        '"Bearer {{ secrets.tok }}"}}}',
        "      - {name: r, hosts: [api.x.com]}")
    assert not res.ok
    assert res.counterexample == "GET https://api.x.com:443/"
    assert "o allows it by rule 'r'" in str(res) and "binds no secret" in str(res)
    assert "rule 'w' of n binds tok on it" in str(res)
    # substitute counts too; the same secret on the other side proves.
    res = narrower(tmp_path, "      - {name: w, hosts: [api.x.com], substitute: [tok2]}",
                   "      - {name: r, hosts: [api.x.com], substitute: [tok]}")
    assert not res.ok and "binds tok2 on it" in str(res)
    assert narrower(tmp_path, "      - {name: w, hosts: [api.x.com], substitute: [tok]}",
                    "      - {name: r, hosts: [api.x.com], substitute: [tok, tok2]}").ok


def test_first_matching_allow_decides_the_secrets(tmp_path):
    other = ("      - {name: plain, hosts: [api.x.com], paths: ['/public/**']}\n"
             "      - {name: keyed, hosts: [api.x.com], substitute: [tok]}")
    # narrow gets tok everywhere, but on /public/** the other's first allow binds nothing.
    res = narrower(tmp_path, "      - {name: w, hosts: [api.x.com], substitute: [tok]}", other)
    assert not res.ok
    assert res.counterexample == "GET https://api.x.com:443/public"
    assert "o allows it by rule 'plain'" in str(res)
    # a narrow identity with the same split proves.
    assert narrower(tmp_path,
                    "      - {name: p, hosts: [api.x.com], paths: ['/public/**']}\n"
                    "      - {name: w, hosts: [api.x.com], substitute: [tok]}", other).ok


def test_deny_in_the_other_cuts_the_grant(tmp_path):
    res = narrower(tmp_path, "      - {name: w, hosts: [a.example.com], methods: [GET]}",
                   "      - {name: r, hosts: [a.example.com], methods: [GET]}\n"
                   "      - {name: no-admin, action: deny, hosts: ['*.example.com'],"
                   " paths: ['/admin/**']}")
    assert not res.ok
    assert res.counterexample == "GET https://a.example.com:443/admin"
    assert "deny rule 'no-admin' of identity 'o' matches" in str(res)
    # the same deny in the narrow identity makes it hold; a deny ordered first still wins.
    assert narrower(tmp_path,
                    "      - {name: nope, action: deny, hosts: [a.example.com], paths: ['/admin',"
                    " '/admin/**']}\n"
                    "      - {name: w, hosts: [a.example.com], methods: [GET]}",
                    "      - {name: r, hosts: [a.example.com], methods: [GET]}\n"
                    "      - {name: no-admin, action: deny, hosts: ['*.example.com'],"
                    " paths: ['/admin/**']}").ok


def test_ports_and_schemes(tmp_path):
    res = narrower(tmp_path, "      - {name: w, hosts: [a.example.com], ports: [443, 8443]}",
                   "      - {name: r, hosts: [a.example.com]}")
    assert not res.ok and res.counterexample == "GET https://a.example.com:8443/"
    res = narrower(tmp_path, "      - {name: w, hosts: [a.example.com], schemes: [http, https]}",
                   "      - {name: r, hosts: [a.example.com], ports: [80, 443]}")
    assert not res.ok and res.counterexample == "GET http://a.example.com:80/"
    assert narrower(tmp_path, "      - {name: w, hosts: [a.example.com], schemes: [http]}",
                    "      - {name: r, hosts: [a.example.com], schemes: [http, https]}").ok


def test_private_cidrs(tmp_path):
    res = narrower(tmp_path,
                   "      - {name: w, hosts: [db.internal.example], private_cidrs: [10.0.0.0/8]}",
                   "      - {name: r, hosts: [db.internal.example],"
                   " private_cidrs: [10.0.0.0/9]}")
    assert not res.ok and "private_cidrs" in str(res)
    assert narrower(tmp_path,
                    "      - {name: w, hosts: [db.internal.example],"
                    " private_cidrs: [10.0.0.0/8]}",
                    "      - {name: r, hosts: [db.internal.example],"
                    " private_cidrs: [10.0.0.0/9, 10.128.0.0/9]}").ok


def test_passthrough(tmp_path):
    # narrow tunnels without interception; the other intercepts (even allowing everything).
    res = narrower(tmp_path, "      - {name: w, hosts: [a.example.com], passthrough: true}",
                   "      - {name: r, hosts: [a.example.com]}")
    assert not res.ok
    assert res.counterexample == "CONNECT a.example.com:443"
    assert "o does not pass it through" in str(res)
    # the other's passthrough is disabled by a deny rule that must inspect requests.
    res = narrower(tmp_path, "      - {name: w, hosts: ['*.example.com'], passthrough: true}",
                   "      - {name: r, hosts: ['*.example.com'], passthrough: true}\n"
                   "      - {name: d, action: deny, hosts: [b.example.com], methods: [POST]}")
    assert not res.ok
    assert res.counterexample == "CONNECT b.example.com:443"
    assert "o refuses it" in str(res)
    assert narrower(tmp_path, "      - {name: w, hosts: [a.example.com], passthrough: true}",
                    "      - {name: r, hosts: ['*.example.com'], passthrough: true}").ok
    # a passthrough rule is never used for an inspected request: no L7 counter-example.
    assert narrower(tmp_path,
                    "      - {name: w, hosts: [a.example.com], passthrough: true}\n"
                    "      - {name: d, action: deny, hosts: [a.example.com], methods: [PUT]}",
                    "      - {name: r, hosts: [b.example.com]}").ok


def test_ipv6_host_counterexample(tmp_path):
    res = narrower(tmp_path, "      - {name: w, hosts: ['::1'], private_cidrs: ['::1/128']}",
                   "      - {name: r, hosts: [a.example.com]}")
    assert not res.ok and res.counterexample == "GET https://[::1]:443/"


def test_narrower_than_unknown_identity_is_a_load_error(tmp_path):
    with pytest.raises(PolicyError) as e:
        load(tmp_path, "  n:\n    narrower_than: nobody\n    rules: []\n")
    [p] = e.value.problems
    assert p.field == "identities.n.narrower_than" and p.line == 7
    assert "unknown identity 'nobody'" in p.message


# --- secret hosts -------------------------------------------------------------------------------


def secret_policy(tmp_path: Path, hosts: str, rules: str) -> Policy:
    head = f"""version: v1
secrets:
  tok: {{vault: secret/data/tok, field: v, hosts: {hosts}}}
identities:
"""
    return load(tmp_path, f"  a:\n    rules:\n{rules}\n", head=head)


INJ = 'inject: {headers: {x-api-key: "{{ secrets.tok }}"}}'


def test_secret_hosts_holds(tmp_path):
    pol = secret_policy(tmp_path, "[api.x.com, '*.y.com']",
                        f"      - {{name: a, hosts: [api.x.com, b.y.com, '*.c.y.com'], {INJ}}}\n"
                        "      - {name: other, hosts: [evil.example]}")
    assert [str(r) for r in prove(pol)] == ["proof ok: secret tok only to api.x.com, *.y.com"]


def test_secret_hosts_catches_an_exact_host(tmp_path):
    pol = secret_policy(tmp_path, "[api.x.com]",
                        f"      - {{name: ok, hosts: [api.x.com], {INJ}}}\n"
                        f"      - {{name: leak, hosts: [api.x.com, evil.example], {INJ}}}")
    [res] = prove(pol)
    assert not res.ok and res.counterexample == "evil.example"
    assert "rule 'leak' of identity 'a'" in str(res)
    assert re.search(r"p\.yaml:\d+\) injects it for host pattern evil\.example", str(res))


def test_secret_hosts_catches_a_wildcard(tmp_path):
    pol = secret_policy(tmp_path, "[api.x.com]",
                        "      - {name: leak, hosts: ['*.x.com'], substitute: [tok]}")
    [res] = prove(pol)
    assert not res.ok and res.counterexample == "x.x.com"
    assert "substitutes it for host pattern *.x.com, which matches x.x.com" in str(res)
    # a wildcard does not cover its apex
    pol = secret_policy(tmp_path, "['*.x.com']", f"      - {{name: leak, hosts: [x.com], {INJ}}}")
    [res] = prove(pol)
    assert not res.ok and res.counterexample == "x.com"
    # the witness avoids exact hosts that are allowed
    pol = secret_policy(tmp_path, "[x.x.com, y.x.com]",
                        f"      - {{name: leak, hosts: ['*.x.com'], {INJ}}}")
    [res] = prove(pol)
    assert not res.ok and res.counterexample == "z.x.com"


def test_secret_hosts_bad_pattern_is_a_load_error(tmp_path):
    with pytest.raises(PolicyError) as e:
        secret_policy(tmp_path, "['*']", "      - {name: r, hosts: [a.com]}")
    assert e.value.problems[0].field == "secrets.tok.hosts[0]"


def test_deny_rules_do_not_excuse_a_secret_rule(tmp_path):
    # The claim is about rule patterns: a shadowed rule that names another host still fails.
    pol = secret_policy(tmp_path, "[api.x.com]",
                        "      - {name: d, action: deny, hosts: [evil.example]}\n"
                        f"      - {{name: leak, hosts: [api.x.com, evil.example], {INJ}}}")
    assert not prove_secret_hosts(pol, "tok").ok


# --- paths as automata agree with PathPattern.matches ------------------------------------------

SEG_GLOBS = ["a", "b", "ab", ".a", "a.b", "*", "**", "a*", "*b", "a*b", "*a*", "é*", "?", "%"]
SEGS = ["a", "b", "ab", "ba", "aab", "abb", ".a", "...", "a.b", "é", "éb", "?", "%", "a b", "x"]


@st.composite
def globs(draw: Any) -> str:
    segs = draw(st.lists(st.sampled_from(SEG_GLOBS), max_size=4))
    segs = [s for s in segs if s not in ("?", "%")]  # not allowed in globs
    trailing = draw(st.booleans())
    return "/" + "/".join(segs) + ("/" if trailing and segs else "")


@st.composite
def norm_paths(draw: Any) -> str:
    segs = draw(st.lists(st.sampled_from(SEGS), max_size=5))
    if not segs:
        return "/"
    return "/" + "/".join(segs) + ("/" if draw(st.booleans()) else "")


@settings(max_examples=examples(150), deadline=None)
@given(globs(), st.lists(norm_paths(), min_size=1, max_size=8))
def test_glob_automaton_agrees_with_matches(glob, paths):
    p = compile_path_pattern(glob)
    nfa = glob_nfa((p,))
    rx = re.compile(glob_regex(p), re.DOTALL)
    for path in paths:
        assert is_normalised_path(path)
        want = p.matches(path)
        assert nfa.matches(path) == want, (glob, path)
        assert (rx.fullmatch(path) is not None) == want, (glob, path)


V_RX = re.compile(NORMALISED_PATH_REGEX, re.DOTALL)


@settings(max_examples=examples(200), deadline=None)
@given(st.text(alphabet="/.\\ab\x01\x7fé", max_size=12))
def test_normalised_path_language_is_exactly_the_fixed_points(s):
    """A string without %, ? and # is a normalised path iff normalise_path leaves it alone."""
    fixed = False
    try:
        fixed = s.startswith("/") and normalise_path(s) == s
    except ValueError:
        pass
    assert is_normalised_path(s) == fixed, s
    assert (V_RX.fullmatch(s) is not None) == fixed, s


@settings(max_examples=examples(120), deadline=None)
@given(st.text(max_size=20).map(lambda t: "/" + t))
def test_every_normalised_path_is_in_the_language(raw):
    try:
        p = normalise_path(raw)
    except ValueError:
        return
    assert is_normalised_path(p)
    assert V_RX.fullmatch(p)


def _g(*globs: str) -> tuple[Any, ...]:
    return tuple(compile_path_pattern(g) for g in globs)


def test_witness_paths_are_real_paths():
    for glob in ["/v1/**", "/a*b/*/c/", "/**/x", "/", "/.a*", "/é*"]:
        w = find_path([_g(glob)], lambda v: v[0])
        assert w is not None and compile_path_pattern(glob).matches(w), glob
        assert normalise_path(raw_path(w)) == w
    for w in ["/a b", "/%", "/?x", "/#", "/é", "/.x", "/..."]:
        assert normalise_path(raw_path(w)) == w
    assert find_path([_g("/a"), _g("/*")], lambda v: v[0] and not v[1]) is None
    assert find_path([_g("/v1/**"), _g("/v1/*")], lambda v: v[0] and not v[1]) == "/v1"
    # the stand-in character: "/a*" minus "/a", "/ab" needs a character that is neither b nor /
    assert find_path([_g("/a*"), _g("/a", "/ab")], lambda v: v[0] and not v[1]) == "/aa"
    assert find_path([None, _g("/**")], lambda v: v[0] and not v[1]) is None


greenery = pytest.importorskip("greenery")


@settings(max_examples=examples(40), deadline=None)
@given(globs(), globs(), globs())
def test_find_path_agrees_with_greenery(g1, g2, g3):
    """An independent automata library decides the same emptiness questions."""
    p1, p2, p3 = (compile_path_pattern(g) for g in (g1, g2, g3))
    v = greenery.parse(NORMALISED_PATH_REGEX).to_fsm()
    f1, f2, f3 = (greenery.parse(glob_regex(p)).to_fsm() for p in (p1, p2, p3))
    for bad, fsm in [(lambda m: m[0] and not m[1], (f1 & v) - f2),
                     (lambda m: m[0] and not (m[1] or m[2]), (f1 & v) - (f2 | f3)),
                     (lambda m: m[0] and m[1] and not m[2], (f1 & f2 & v) - f3)]:
        w = find_path([(p1,), (p2,), (p3,)], bad)
        assert (w is None) == fsm.empty(), (g1, g2, g3, w)
        if w is not None:
            assert fsm.accepts(w) and is_normalised_path(w)
            assert bad([p1.matches(w), p2.matches(w), p3.matches(w)])


# --- hosts --------------------------------------------------------------------------------------

HOST_PATS = ["example.com", "a.example.com", "x.example.com", "*.example.com", "*.a.example.com",
             "b.a.example.com", "other.org", "*.other.org"]
LABELS = ["a", "b", "x", "y", "example", "other", "com", "org", "q"]


@settings(max_examples=examples(120), deadline=None)
@given(st.lists(st.sampled_from(HOST_PATS), min_size=1, max_size=5),
       st.lists(st.sampled_from(LABELS), max_size=3),
       st.sampled_from(["example.com", "a.example.com", "b.a.example.com", "other.org", "org"]))
def test_host_witnesses_cover_every_class(pats, labels, base):
    patterns = [compile_host_pattern(p) for p in pats]
    host = normalise_host(".".join([*labels, base]))
    vec = tuple(p.matches(host) for p in patterns)
    assume(any(vec))
    ws = host_witnesses(patterns)
    assert any(tuple(p.matches(w) for p in patterns) == vec for w in ws), (host, ws)
    for w in ws:
        assert normalise_host(w) == w


# --- the proof agrees with decide() on random policies -----------------------------------------


def gate_ok(narrow: AskPolicy | None, other: AskPolicy | None) -> bool:
    """A reference for the approval part of narrower_than, written apart from the prover: the
    narrow identity's gate is at least as strict as the other's."""
    if other is None:
        return True
    if narrow is None:
        return False
    return (narrow.require_approvers >= other.require_approvers
            and (other.approvers is None or (narrow.approvers is not None
                                             and set(narrow.approvers) <= set(other.approvers)))
            and (narrow.mode == "hold" or other.mode == "async")
            and set(narrow.remember) <= set(other.remember)
            and ((narrow.remember == ("request",) and other.remember == ("request",))
                 or narrow.max_remember_ttl <= other.max_remember_ttl))

# --- public: true, query: and max_request_bytes ----------------------------------------------


def test_public_where_other_names_hosts_is_refuted(tmp_path):
    res = narrower(tmp_path, "      - {name: w, public: true, methods: [GET]}\n",
                   "      - {name: r, hosts: ['*.example.com', pypi.org], methods: [GET]}\n")
    assert not res.ok and res.counterexample == "GET https://x:443/"


def test_public_narrower_than_public_proves(tmp_path):
    assert narrower(tmp_path, "      - {name: w, public: true, methods: [GET]}\n"
                    "      - {name: p, hosts: [pypi.org], methods: [HEAD]}\n",
                    "      - {name: w, public: true}\n").ok
    res = narrower(tmp_path, "      - {name: w, public: true}\n",
                   "      - {name: w, public: true, methods: [GET]}\n")
    assert not res.ok and res.counterexample is not None
    assert res.counterexample.split()[0] != "GET"


def test_named_private_host_is_not_covered_by_public(tmp_path):
    res = narrower(tmp_path, "      - {name: i, hosts: [wiki.corp.test], private_cidrs: "
                   "[10.0.0.0/8]}\n", "      - {name: w, public: true}\n")
    assert not res.ok and "private_cidrs" in str(res)


QN = "      - {name: q, hosts: [git.example.com], query: {service: [git-upload-pack]}}\n"


def test_query_equal_proves_and_wider_is_refuted(tmp_path):
    assert narrower(tmp_path, QN, QN).ok
    both = QN.replace("[git-upload-pack]", "[git-upload-pack, git-receive-pack]")
    res = narrower(tmp_path, both, QN)
    assert not res.ok
    assert res.counterexample == "GET https://git.example.com:443/?service=git-receive-pack"


def test_no_query_where_other_needs_one_is_refuted(tmp_path):
    res = narrower(tmp_path, "      - {name: q, hosts: [git.example.com]}\n", QN)
    assert not res.ok and res.counterexample == "GET https://git.example.com:443/"


def test_query_with_two_names_and_encoded_values(tmp_path):
    other = ("      - {name: q, hosts: [h.example.com], query: {a: {values: ['x y', 'p+q'], "
             "exact: true}, b: ['1']}}\n")  # a '+' the client sends as %2B: `exact`
    assert narrower(tmp_path, other.replace("'x y', ", ""), other).ok
    res = narrower(tmp_path, other.replace("b: ['1']", "b: ['1', '2']"), other)
    assert not res.ok and "b=2" in (res.counterexample or "")
    assert not narrower(tmp_path, other.replace(", b: ['1']", ""), other).ok


def test_query_gives_secret_by_query(tmp_path):
    other = ("      - {name: q, hosts: [h.example.com], query: {s: [a]}, substitute: [tok]}\n"
             "      - {name: any, hosts: [h.example.com]}\n")
    assert narrower(tmp_path, other, other).ok
    res = narrower(tmp_path, "      - {name: q, hosts: [h.example.com], substitute: [tok]}\n",
                   other)
    assert not res.ok and "binds" in str(res)


def test_too_many_query_cells_is_not_proved(tmp_path):
    values = ", ".join(f"v{i}" for i in range(70))
    rule = f"      - {{name: q, hosts: [h.example.com], query: {{a: [{values}], b: [{values}]}}}}\n"
    pol = load(tmp_path, f"  n:\n    narrower_than: o\n    rules:\n{rule}  o:\n    rules:\n{rule}")
    [res] = prove(pol)
    assert not res.ok and res.counterexample is None
    assert "not proved" in str(res) and "query" in str(res)
    assert str(res.source).endswith("p.yaml:6")  # located: where the identity is


@pytest.mark.parametrize(("narrow", "other", "ok"), [
    ("1k", "1k", True), ("1k", "2k", True), ("1k", None, True),
    ("2k", "1k", False), (None, "1k", False), (None, None, True),
])
def test_max_request_bytes(tmp_path, narrow, other, ok):
    def rule(limit: str | None) -> str:
        extra = f", max_request_bytes: {limit}" if limit else ""
        return f"      - {{name: r, hosts: [up.example.com], methods: [POST]{extra}}}\n"

    res = narrower(tmp_path, rule(narrow), rule(other))
    assert res.ok is ok
    if not ok:
        assert "max_request_bytes" in str(res)


R_HOSTS = ["a.example.com", "x.example.com", "example.com", "*.example.com", "*.a.example.com",
           "other.org"]
R_GLOBS = ["/", "/**", "/a", "/a/**", "/a/*", "/*", "/*/b", "/a*", "/a/", "/**/b", "/b/**/a"]
R_METHODS = ["GET", "POST", "HEAD"]
R_QUERIES = [{"service": ["a"]}, {"service": ["a", "b"]}, {"q": ["x"]},
             {"service": ["b"], "q": ["x"]}]


@st.composite
def rule_specs(draw: Any, i: int) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": f"r{i}",
                            "hosts": draw(st.lists(st.sampled_from(R_HOSTS), min_size=1,
                                                   max_size=2, unique=True))}
    action = draw(st.sampled_from(["allow", "allow", "deny"]))
    if action == "deny":
        spec["action"] = "deny"
    if action == "allow" and draw(st.integers(0, 7)) == 0:
        spec["passthrough"] = True
        if draw(st.booleans()):
            spec["private_cidrs"] = [draw(st.sampled_from(["10.0.0.0/8", "10.0.0.0/9"]))]
        return spec
    if action == "allow" and draw(st.integers(0, 6)) == 0:
        del spec["hosts"]
        spec["public"] = True
    if action == "allow" and draw(st.integers(0, 3)) == 0:
        spec["query"] = draw(st.sampled_from(R_QUERIES))
    if draw(st.booleans()):
        spec["methods"] = draw(st.lists(st.sampled_from(R_METHODS), min_size=1, max_size=2,
                                        unique=True))
    if draw(st.booleans()):
        spec["paths"] = draw(st.lists(st.sampled_from(R_GLOBS), min_size=1, max_size=2,
                                      unique=True))
    if draw(st.integers(0, 3)) == 0:
        spec["ports"] = draw(st.lists(st.sampled_from([443, 8443]), min_size=1, unique=True))
    secrets = draw(st.lists(st.sampled_from(["s1", "s2"]), max_size=2, unique=True))
    if action == "allow" and secrets and not spec.get("public"):
        spec["substitute"] = secrets
    elif action == "allow" and draw(st.integers(0, 3)) == 0:
        spec["schemes"] = draw(st.sampled_from([["http"], ["http", "https"]]))
    if action == "allow" and not spec.get("public") and draw(st.integers(0, 5)) == 0:
        spec["private_cidrs"] = [draw(st.sampled_from(["10.0.0.0/8", "10.0.0.0/9"]))]
    if action == "allow" and draw(st.integers(0, 3)) == 0:  # ask wins over every allow rule
        spec["action"] = "ask"
        spec["approval"] = draw(st.sampled_from([{}, {"require_approvers": 2}, {"mode": "async"},
                                                 {"remember": ["request", "sandbox"]}]))
    return spec


def identity(name: str, specs: list[dict[str, Any]]) -> Identity:
    from sandgate.policy.schema import RuleSpec

    problems: list[str] = []
    comp = compile_identity(name, [(i, RuleSpec.model_validate(s)) for i, s in enumerate(specs)],
                            "mem.yaml", lambda loc: 1,
                            lambda loc, msg, fix: problems.append(f"{loc}: {msg}"))
    # Random rule sets may combine what the loader refuses (e.g. a passthrough rule beside an
    # intercepted allow on the same host): such a policy never loads, so it proves nothing.
    assume(not problems)
    return Identity(name=name, rules=tuple(comp.rules), source=Source("mem.yaml", 1))


SECRETS = {n: SecretRef(name=n, mount="secret", path=n, field="v", kv_version=2,
                        placeholder=f"sandgate-placeholder-{n}", source=Source("mem.yaml", 1))
           for n in ("s1", "s2")}


@st.composite
def policies(draw: Any) -> Policy:
    n = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=3))
    n_specs = [draw(rule_specs(i)) for i in range(len(n))]
    extra = draw(st.lists(st.integers(0, 10**6), max_size=3))
    e_specs = [draw(rule_specs(10 + i)) for i in range(len(extra))]
    # Half the time the other identity starts from the narrow one's rules (and adds more, deny
    # rules included), so that both outcomes are common.
    if draw(st.booleans()):
        base = [dict(s, name=f"c{i}") for i, s in enumerate(n_specs)]
        where = draw(st.integers(0, len(e_specs)))
        o_specs = e_specs[:where] + base + e_specs[where:]
    else:
        o_specs = e_specs or [draw(rule_specs(20))]
    return Policy(identities={"n": identity("n", n_specs), "o": identity("o", o_specs)},
                  secrets=SECRETS)


GRID_HOSTS = ["a.example.com", "x.example.com", "y.example.com", "q.a.example.com",
              "example.com", "other.org", "z.other.org", "x", "10.0.0.1"]
GRID_QUERIES = ["", "service=a", "service=b", "service=c", "service=a&service=b", "q=x",
                "service=a&q=x", "service=b&q=x&q=x", "service=a+"]
GRID_PATHS = ["/", "/a", "/a/", "/a/b", "/a/b/", "/b", "/b/a", "/b/c/a", "/ab", "/a/a/b", "/c",
              "/c/b", "/a%2Fb", "/x/..", "/%61b"]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies())
def test_proof_agrees_with_decide(pol):
    res = prove_narrower(pol, "n", "o")  # a counter-example decide() disagrees with raises
    event("proved" if res.ok else f"refuted by {(res.counterexample or '?').split()[0]}")
    if not res.ok:
        check_counterexample(pol, "n", "o", res)
        return
    # Proved: no request of a brute-force grid refutes it.
    for host in GRID_HOSTS:
        for port in (443, 8443, 80):
            dn = decide_connect(pol, "n", host, port)
            if dn.allowed and dn.rule is not None and dn.rule.passthrough:
                do = decide_connect(pol, "o", host, port)
                assert do.allowed and do.rule is not None and do.rule.passthrough
                assert cidrs_covered(dn.rule.private_cidrs, do.rule.private_cidrs)
            for scheme in ("https", "http"):
                for method in ("GET", "POST", "HEAD", "PUT"):
                    for path, qs in [(p, "") for p in GRID_PATHS] + [
                            ("/a", q) for q in GRID_QUERIES]:
                        req = RequestInfo(scheme, host, port, method, path, parse_query(qs))
                        d1 = decide_request(pol, "n", req)
                        if not d1.allowed or d1.tunnel:  # a tunnel: checked as the CONNECT
                            continue
                        d2 = decide_request(pol, "o", req)  # a tunnel is reach, no secret
                        assert d2.allowed, (req, d2.reason)
                        assert d1.rule is not None and d2.rule is not None
                        assert d1.rule.secrets <= d2.rule.secrets, req
                        assert cidrs_covered(d1.rule.private_cidrs, d2.rule.private_cidrs)
                        assert gate_ok(d1.rule.ask, d2.rule.ask), req


def test_cidrs_covered():
    import ipaddress

    n = ipaddress.ip_network
    assert cidrs_covered([n("10.0.0.0/8")], [n("10.0.0.0/9"), n("10.128.0.0/9")])
    assert not cidrs_covered([n("10.0.0.0/8")], [n("10.0.0.0/9")])
    assert cidrs_covered([], [])
    assert not cidrs_covered([n("fd00::/64")], [n("10.0.0.0/8")])
    assert cidrs_covered([n("10.1.2.0/24")], [n("10.0.0.0/8")])
