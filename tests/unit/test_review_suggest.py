"""`sandgate suggest`: a least-privilege policy from recorded traffic, round-tripped.

The suggested policy must load, pass `sandgate check` (its own fixtures), allow every recorded
request, and refuse near misses (other methods, sibling paths not seen, other hosts, schemes,
ports) except where a collapse rule deliberately covers them; each such case says which rule.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sandgate.decision import judge
from sandgate.policy.fixtures import run_policy_tests
from sandgate.policy.loader import load_policy_dir
from sandgate.review.lint import lint_dir
from sandgate.review.suggest import collapse_hosts, collapse_paths, id_like, suggest
from sandgate.review.traffic import read_audit
from tests.unit.audit_log import Recorder

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[2]

# (identity, method, url, extra audit fields): what the proxy let out.
GRANTED = [
    ("agent", "POST", "https://api.anthropic.com/v1/messages",
     {"secrets": ["anthropic@3"], "rule": "llm"}),
    ("agent", "POST", "https://api.anthropic.com/v1/messages?beta=true",
     {"secrets": ["anthropic@3"]}),
    ("agent", "GET", "https://api.anthropic.com/v1/models", {}),
    ("agent", "GET", "https://api.github.com/repos/o/r/issues/1", {}),
    ("agent", "GET", "https://api.github.com/repos/o/r/issues/2", {}),
    ("agent", "GET", "https://api.github.com/repos/o/r/issues/3?per_page=5", {}),
    ("agent", "GET", "https://api.github.com/repos/o/r/commits/0123456789abcdef0123", {}),
    ("agent", "GET", "https://api.github.com/repos/o/r", {}),
    ("agent", "GET", "https://api.github.com/repos/o/r/", {}),
    ("agent", "GET", "https://pypi.org/simple/requests/", {}),
    ("agent", "HEAD", "https://pypi.org/simple/requests/", {}),
    ("agent", "GET", "https://a.docs.example.org/guide", {}),
    ("agent", "GET", "https://b.docs.example.org/guide", {}),
    ("agent", "GET", "https://c.docs.example.org/api", {}),
    ("agent", "GET", "https://x.github.io/", {}),
    ("agent", "GET", "https://y.github.io/", {}),
    ("agent", "GET", "https://z.github.io/", {}),
    ("agent", "GET", "http://10.0.0.5:8080/metrics", {"dialed": "10.0.0.5:8080"}),
    ("agent", "GET", "https://internal.example.com/health", {"dialed": "10.1.2.3:443"}),
    ("agent", "GET", "https://reported.example.net/a",
     {"decision": "report", "code": "no_rule"}),
    ("agent", "PUT", "https://files.example.com/v1/objects/8f14e45f-ceea-467f-a0f6-0b1f0f7e6a11",
     {}),
    ("tool", "GET", "https://docs.python.org/3/", {}),
    ("tool", "GET", "https://docs.python.org/3/library/json.html", {}),
]
# Recorded but not granted by default.
REFUSED = [
    ("agent", "GET", "https://evil.example/x", {"decision": "deny", "code": "no_rule"}),
    ("agent", "POST", "https://api.github.com/gists", {"decision": "deny",
                                                       "code": "exfiltration"}),
    ("tool", "FOO", "https://docs.python.org/3/", {}),  # no rule can name this method
]

# (identity, method, url, allowed?, why). Allowed near misses are the collapses at work.
NEAR_MISSES = [
    ("agent", "GET", "https://api.anthropic.com/v1/messages", False, "other method"),
    ("agent", "POST", "https://api.anthropic.com/v1/complete", False, "sibling path"),
    ("agent", "POST", "https://api.anthropic.com/v1/messages/batches", False, "deeper path"),
    ("agent", "POST", "https://api.anthropic.com/v1/models", False, "GET-only path"),
    ("agent", "DELETE", "https://api.github.com/repos/o/r/issues/1", False, "other method"),
    ("agent", "GET", "https://api.github.com/repos/o/r/pulls/1", False, "sibling path"),
    ("agent", "GET", "https://api.github.com/repos/o/other", False, "sibling repo"),
    ("agent", "GET", "https://api.github.com/repos/o/r/issues/1/comments", False, "no **"),
    ("agent", "GET", "https://api.github.com/repos/o/r/issues/99", True,
     "collapse: issues/1, /2, /3 vary in one segment -> issues/*"),
    ("agent", "GET", "https://api.github.com/repos/o/r/issues/", False,
     "issues/* needs a non-empty segment"),
    ("agent", "GET", "https://api.github.com/repos/o/r/commits/admin", True,
     "collapse: the id-like commit segment -> commits/*"),
    ("agent", "GET", "https://api.github.com/repos/o/r/commits/a/b", False, "one segment only"),
    ("agent", "PUT", "https://files.example.com/v1/objects/other", True,
     "collapse: the UUID segment -> objects/*"),
    ("agent", "GET", "https://files.example.com/v1/objects/other", False, "PUT only"),
    ("agent", "GET", "https://d.docs.example.org/guide", True,
     "collapse: a, b, c.docs.example.org -> *.docs.example.org"),
    ("agent", "GET", "https://d.docs.example.org/other", False, "path not seen"),
    ("agent", "GET", "https://docs.example.org/guide", False, "the apex is not *."),
    ("agent", "GET", "https://w.github.io/", False, "no wildcard over a public suffix"),
    ("agent", "GET", "https://pypi.org/simple/numpy/", False, "only one package seen"),
    ("agent", "POST", "https://pypi.org/simple/requests/", False, "other method"),
    ("agent", "GET", "http://api.github.com/repos/o/r", False, "other scheme"),
    ("agent", "GET", "https://api.github.com:8443/repos/o/r", False, "other port"),
    ("agent", "GET", "https://evil.example/x", False, "recorded as refused"),
    ("agent", "POST", "https://api.github.com/gists", False, "recorded as exfiltration"),
    ("agent", "GET", "http://10.0.0.6:8080/metrics", False, "other host"),
    ("agent", "GET", "http://10.0.0.5:8081/metrics", False, "other port"),
    ("agent", "CONNECT", "db.example.com:5432", False, "a tunnel with nothing recorded inside"),
    ("tool", "GET", "https://api.anthropic.com/v1/models", False, "another identity's host"),
    ("tool", "POST", "https://docs.python.org/3/", False, "other method"),
    ("tool", "GET", "https://docs.python.org/2/", False, "sibling path"),
    ("nobody", "GET", "https://docs.python.org/3/", False, "identity not recorded"),
]


def _recording(order_seed: int | None = None) -> Recorder:
    events = [(i, m, u, kw) for i, m, u, kw in GRANTED + REFUSED]
    if order_seed is not None:
        random.Random(order_seed).shuffle(events)
    r = Recorder()
    r.event("policy", outcome="ok", trigger="start", version="v", previous=None, files=[])
    r.connect("agent", "api.anthropic.com:443", rule="llm")
    r.connect("agent", "db.example.com:5432", rule="db")  # nothing inside: passthrough?
    for ident, method, url, kw in events:
        r.request(ident, method, url, **kw)
    r.request(None, "GET", "https://pypi.org/", decision="deny", code="auth_required")
    return r


def _suggested(tmp_path: Path, **kw: object) -> Path:
    traffic = read_audit(_recording().text().splitlines(), "audit.jsonl")
    text = suggest(traffic, **kw).yaml("audit.jsonl")  # type: ignore[arg-type]
    d = tmp_path / "suggested"
    d.mkdir()
    (d / "suggested.yaml").write_text(text)
    return d


def test_suggest_loads_passes_check_and_allows_every_recorded_request(tmp_path):
    d = _suggested(tmp_path)
    policy = load_policy_dir(d)
    results = run_policy_tests(policy)
    assert results and all(r.passed for r in results), [r.message for r in results
                                                        if not r.passed]
    # One fixture per distinct recorded request (the query is not part of the request), plus
    # the CONNECT whose host the rules cover.
    distinct = {(i, m, u.split("?")[0]) for i, m, u, _ in GRANTED}
    assert len(results) == len(distinct) + 1
    for ident, method, url, _kw in GRANTED:
        v = judge(policy, ident, method, url, {})
        assert v.decision.allowed, (ident, method, url, v.decision.reason)
    assert judge(policy, "agent", "CONNECT", "api.anthropic.com:443", {}).decision.allowed


@pytest.mark.parametrize(("ident", "method", "url", "allowed", "why"), NEAR_MISSES,
                         ids=[f"{m} {u} ({w})" for _i, m, u, _a, w in NEAR_MISSES])
def test_suggest_refuses_near_misses_unless_a_collapse_covers_them(tmp_path, ident, method, url,
                                                                   allowed, why):
    policy = load_policy_dir(_suggested(tmp_path))
    v = judge(policy, ident, method, url, {})
    assert v.decision.allowed is allowed, (why, v.decision.reason)


def test_suggest_output_shape(tmp_path):
    d = _suggested(tmp_path)
    text = (d / "suggested.yaml").read_text()
    doc = yaml.safe_load(text)
    assert doc["version"] == "v1"
    assert "secrets" not in doc  # none invented
    rules = {r["name"]: r for r in doc["identities"]["agent"]["rules"]}
    # The injecting rule comes first and is marked for a human; it has no inject block.
    first = doc["identities"]["agent"]["rules"][0]
    assert first["hosts"] == ["api.anthropic.com"] and first["paths"] == ["/v1/messages"]
    assert "inject" not in first and "substitute" not in first
    assert "# injected: anthropic\n" in text
    assert text.count("        # injected:") == 1
    # Methods with the same paths share a rule; others do not.
    assert rules["pypi-org-get-head"]["methods"] == ["GET", "HEAD"]
    assert rules["api-github-com-get"]["paths"] == [
        "/repos/o/r", "/repos/o/r/", "/repos/o/r/commits/*", "/repos/o/r/issues/*"]
    assert rules["any-docs-example-org-get"]["hosts"] == ["*.docs.example.org"]
    assert {h for r in rules.values() for h in r["hosts"]} >= {"x.github.io", "y.github.io"}
    # Scheme, port and the dialled private address exactly as recorded.
    metrics = rules["10-0-0-5-http-8080-get"]
    assert metrics["schemes"] == ["http"] and metrics["ports"] == [8080]
    assert metrics["private_cidrs"] == ["10.0.0.5/32"]
    assert rules["internal-example-com-get"]["private_cidrs"] == ["10.1.2.3/32"]
    assert "**" not in text
    # What was not granted is listed, with the audit line.
    assert "# Not granted (" in text
    for needle in ("evil.example:443/x: recorded as deny (no_rule)", "(exfiltration)",
                   "method FOO is not a registered", "CONNECT db.example.com:5432",
                   "before the caller was identified"):
        assert needle in text, needle


def test_suggest_is_deterministic_whatever_the_order(tmp_path):
    texts = {suggest(read_audit(_recording(seed).text().splitlines())).yaml("x")
             for seed in (None, 1, 2, 3)}
    # The notes quote audit line numbers, which move with the order; the policy does not.
    assert len({t.split("\n\n# Not granted")[0] for t in texts}) == 1


def test_suggest_identity_filter_and_include_refused(tmp_path):
    traffic = read_audit(_recording().text().splitlines())
    only_tool = suggest(traffic, identities={"tool"})
    assert set(only_tool.rules) == {"tool"}
    assert all(i == "tool" for i, _ in only_tool.tests)
    wider = suggest(traffic, include_refused=True)
    hosts = {r.host for r in wider.rules["agent"]}
    assert "evil.example" in hosts  # a no_rule refusal, granted on request
    assert not any(r.host == "api.github.com" and "POST" in r.methods
                   for r in wider.rules["agent"])  # exfiltration never


def test_suggest_collapse_deep(tmp_path):
    d = _suggested(tmp_path, collapse_deep=True)
    policy = load_policy_dir(d)
    assert all(r.passed for r in run_policy_tests(policy))
    text = (d / "suggested.yaml").read_text()
    # The longest common prefix of the paths under /repos.
    assert '"/repos/o/**"' in text and '"/**"' not in text
    # Deliberately broader: anything under /repos/o for GET; nothing outside it.
    assert judge(policy, "agent", "GET", "https://api.github.com/repos/o/y/z", {}).decision.allowed
    for url in ("https://api.github.com/repos/x/y", "https://api.github.com/user"):
        assert not judge(policy, "agent", "GET", url, {}).decision.allowed


def test_suggested_policy_lints_clean_of_errors(tmp_path):
    findings = lint_dir(_suggested(tmp_path))
    # Warnings may remain (e.g. identities without fixtures are impossible here); none are
    # about secrets or wildcards over public suffixes.
    assert not [f for f in findings if "public suffix" in f.message or "secret" in f.message]


def test_suggest_cli_writes_a_file_check_accepts(tmp_path):
    log = tmp_path / "audit.jsonl"
    log.write_text(_recording().text())
    out = tmp_path / "pol" / "suggested.yaml"
    out.parent.mkdir()
    cmd = [sys.executable, "-m", "sandgate.cli"]
    r = subprocess.run([*cmd, "suggest", "--from", str(log), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "not granted" in r.stderr
    r = subprocess.run([*cmd, "check", str(out.parent)], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout
    r = subprocess.run([*cmd, "suggest", "--from", str(log), "--identity", "nobody"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and "nothing to grant" in r.stderr


# --- the collapse rules on their own ---------------------------------------------------------


def test_id_like():
    assert id_like("0123456789abcdef") and id_like("12345678")
    assert id_like("8f14e45f-ceea-467f-a0f6-0b1f0f7e6a11")
    assert not id_like("1234567") and not id_like("deadbeefcafe") and not id_like("messages")


def test_collapse_paths():
    assert collapse_paths(["/a/1/x", "/a/2/x"]) == ["/a/1/x", "/a/2/x"]  # two do not vary
    assert collapse_paths(["/a/1/x", "/a/2/x", "/a/3/x"]) == ["/a/*/x"]
    assert collapse_paths(["/a/1/x", "/a/2/y", "/a/3/z"]) == ["/a/1/x", "/a/2/y", "/a/3/z"]
    assert collapse_paths(["/u/1", "/u/2", "/u/3", "/u/"]) == ["/u/", "/u/*"]
    assert collapse_paths(["/f/a*b", "/f/%"]) == ["/f/*"]  # unspellable in a glob
    assert collapse_paths(["/"]) == ["/"]
    assert collapse_paths(["/v1/a/b", "/v1/c", "/v1/d/e/f"]) == ["/v1/a/b", "/v1/c", "/v1/d/e/f"]
    assert collapse_paths(["/v1/a/b", "/v1/c", "/v1/d/e/f"], deep=True) == ["/v1/**"]
    assert collapse_paths(["/a", "/b", "/c"], deep=True) == ["/*"]  # never /**


def test_collapse_hosts():
    got = collapse_hosts(["a.ex.com", "b.ex.com", "ex.com", "x.a.ex.com", "q.co.uk", "r.co.uk",
                          "s.co.uk", "1.2.3.4", "p.ex.net", "q.ex.net"])
    assert (got["a.ex.com"], got["x.a.ex.com"]) == ("a.ex.com", "x.a.ex.com")  # two siblings
    assert got["ex.com"] == "ex.com"
    assert got["q.co.uk"] == "q.co.uk"  # a public suffix: never *.co.uk
    assert got["1.2.3.4"] == "1.2.3.4"
    assert got["p.ex.net"] == "p.ex.net"  # two siblings are not enough
    three = collapse_hosts(["a.ex.com", "b.ex.com", "c.ex.com", "x.a.ex.com", "ex.com"])
    assert three == {"a.ex.com": "*.ex.com", "b.ex.com": "*.ex.com", "c.ex.com": "*.ex.com",
                     "x.a.ex.com": "*.ex.com", "ex.com": "ex.com"}
    assert set(collapse_hosts(["a.github.io", "b.github.io", "c.github.io"]).values()) == {
        "a.github.io", "b.github.io", "c.github.io"}
    assert set(collapse_hosts(["a.s3.amazonaws.com", "b.s3.amazonaws.com",
                               "c.s3.amazonaws.com"]).values()) == {
        "a.s3.amazonaws.com", "b.s3.amazonaws.com", "c.s3.amazonaws.com"}
