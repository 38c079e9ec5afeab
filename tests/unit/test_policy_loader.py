"""Loading policy files: every broken file names file, line, field and a fix; good files compile."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.policy.loader import (
    PolicyError,
    PolicyProblem,
    load_policy_dir,
    load_policy_files,
    policy_json_schema,
)
from sandgate.policy.model import SecretSlot

FIX = Path(__file__).parents[1] / "fixtures" / "policies"
ROOT = Path(__file__).parents[2]

# (file in broken/, line, field, message fragment)
BROKEN = [
    ("yaml_syntax.yaml", 6, "", "YAML syntax error"),
    ("not_mapping.yaml", 1, "", "not a mapping"),
    ("empty.yaml", 1, "", "empty"),
    ("missing_version.yaml", 1, "version", "missing `version`"),
    ("bad_version.yaml", 1, "version", "unknown version 'v2'"),
    ("unknown_top_key.yaml", 2, "identites", "unknown key 'identites'"),
    ("unknown_rule_key.yaml", 7, "identities.a.rules[0].method", "unknown key 'method'"),
    ("unknown_inject_key.yaml", 10, "identities.a.rules[0].inject.header", "unknown key"),
    ("host_star.yaml", 6, "identities.a.rules[0].hosts[1]", "'*'"),
    ("host_tld_wildcard.yaml", 8, "identities.a.rules[0].hosts[1]", "single label"),
    ("host_middle_wildcard.yaml", 5, "identities.a.rules[0].hosts[0]", "whole leading label"),
    ("host_partial_wildcard.yaml", 5, "identities.a.rules[0].hosts[0]", "whole leading label"),
    ("host_double_star.yaml", 5, "identities.a.rules[0].hosts[0]", "whole leading label"),
    ("host_scheme.yaml", 5, "identities.a.rules[0].hosts[0]", "scheme"),
    ("host_port.yaml", 5, "identities.a.rules[0].hosts[0]", "port"),
    ("host_path.yaml", 5, "identities.a.rules[0].hosts[0]", "path"),
    ("host_space.yaml", 5, "identities.a.rules[0].hosts[0]", "spaces"),
    ("hosts_empty.yaml", 5, "identities.a.rules[0].hosts", "must not be empty"),
    ("hosts_missing.yaml", 5, "identities.a.rules[0].hosts", "required key `hosts`"),
    ("path_double_star.yaml", 7, "identities.a.rules[0].paths[1]", "whole segment"),
    ("path_relative.yaml", 7, "identities.a.rules[0].paths[0]", "must start with '/'"),
    ("inject_http.yaml", 10, "identities.a.rules[0].inject", "only injected over TLS"),
    ("substitute_http.yaml", 10, "identities.a.rules[0].substitute", "only injected over TLS"),
    ("substitute_headers_alone.yaml", 7, "identities.a.rules[0].substitute_headers",
     "without substitute does nothing"),
    ("oauth2_http_token_url.yaml", 6, "secrets.crm.oauth2.token_url", "must be an https URL"),
    ("oauth2_token_url_query.yaml", 6, "secrets.crm.oauth2.token_url", "without a query"),
    ("oauth2_kv1.yaml", 6, "secrets.crm.kv_version", "needs KV version 2"),
    ("oauth2_per_sandbox.yaml", 4, "secrets.crm.vault", "cannot use {{ identity }}"),
    ("oauth2_bad_grant.yaml", 5, "secrets.crm.oauth2.grant", "'password' is not allowed"),
    ("github_app_http.yaml", 8, "secrets.gh.github_app.api_url", "must be an https URL"),
    ("github_app_bad_repo.yaml", 13, "identities.a.rules[0].github_app.repositories[0]",
     "not a repository name"),
    ("github_app_bad_level.yaml", 13, "identities.a.rules[0].github_app.permissions.contents",
     "'owner' is not allowed"),
    ("github_app_and_oauth2.yaml", 5, "secrets.gh.github_app", "only one of"),
    ("sign_not_aws.yaml", 9, "identities.a.rules[0].inject.sign", "needs an `aws:` secret"),
    ("aws_in_template.yaml", 9, "identities.a.rules[0].inject.headers.x-key",
     "it signs, it is never sent"),
    ("aws_bad_region.yaml", 3, "secrets.aws.aws.region", "not a valid AWS name"),
    ("sign_scope_unknown.yaml", 9, "identities.a.rules[0].inject.sign",
     "SigV4 region of secret 'aws' is not named"),
    ("operations_not_signed.yaml", 9, "identities.a.rules[0].operations",
     "this rule signs nothing"),
    ("copy_sources_not_signed.yaml", 7, "identities.a.rules[0].copy_sources",
     "this rule signs nothing"),
    ("copy_sources_bad.yaml", 10, "identities.a.rules[0].copy_sources[0]",
     "must start with '/'"),
    ("operations_bad.yaml", 10, "identities.a.rules[0].operations[1]",
     "not an AWS operation name"),
    ("sign_bad_rule_region.yaml", 9, "identities.a.rules[0].inject.sign.region",
     "not a valid AWS name"),
    ("substitute_body_alone.yaml", 7, "identities.a.rules[0].substitute_body",
     "without substitute does nothing"),
    ("substitute_headers_bad_name.yaml", 10, "identities.a.rules[0].substitute_headers[0]",
     "not a valid HTTP header name"),
    ("passthrough_l7.yaml", 8, "identities.a.rules[0].passthrough", "cannot see HTTP"),
    ("deny_inject.yaml", 10, "identities.a.rules[0].inject", "deny rule cannot inject"),
    ("undeclared_secret.yaml", 11, "identities.a.rules[0].inject.headers.authorization",
     "secret 'anthropik' is not declared"),
    ("undeclared_substitute.yaml", 7, "identities.a.rules[0].substitute[0]",
     "secret 'ghost' is not declared"),
    ("bad_template.yaml", 10, "identities.a.rules[0].inject.query.key", "'{{ s }}'"),
    ("unquoted_template.yaml", 11, "", "YAML syntax error"),
    ("bad_header_name.yaml", 11, "identities.a.rules[0].inject.headers.x api key",
     "not a valid HTTP header name"),
    ("dup_rule_name.yaml", 6, "identities.a.rules[1].name", "used twice"),
    ("dup_key_same_file.yaml", 5, "identities.a", "appears twice"),
    ("bad_port.yaml", 7, "identities.a.rules[0].ports[1]", "70000 is out of range"),
    ("port_string.yaml", 7, "identities.a.rules[0].ports[0]", "expected an integer"),
    ("bad_cidr.yaml", 7, "identities.a.rules[0].private_cidrs[1]", "not a valid CIDR"),
    ("bad_scheme.yaml", 7, "identities.a.rules[0].schemes[0]", "'ftp' is not allowed"),
    ("bad_method.yaml", 7, "identities.a.rules[0].methods[1]", "not a valid HTTP method"),
    ("bad_action.yaml", 6, "identities.a.rules[0].action", "'block' is not allowed"),
    ("vault_no_data.yaml", 4, "secrets.legacy.vault", "not a KV v2 API path"),
    ("vault_and_mount.yaml", 3, "secrets.s.vault", "not both"),
    ("secret_no_field.yaml", 3, "secrets.s.field", "required key `field`"),
    ("secret_no_location.yaml", 3, "secrets.s", "neither `vault` nor `mount`"),
    ("short_placeholder.yaml", 3, "secrets.s.placeholder", "shorter than 8"),
    ("dup_placeholder.yaml", 4, "secrets.b.placeholder", "also used by secret 'a'"),
    ("test_unknown_identity.yaml", 7, "tests[1].identity", "unknown identity 'b'"),
    ("test_bad_request.yaml", 6, "tests[0].request", "not 'METHOD URL'"),
    ("test_bad_url.yaml", 6, "tests[0].request", "https:// or http://"),
    ("test_userinfo.yaml", 6, "tests[0].request", "userinfo"),
    ("test_unknown_rule.yaml", 7, "tests[0].rule", "no rule 'rr'"),
    ("test_bad_expect.yaml", 6, "tests[0].expect", "'maybe' is not allowed"),
    # soundness: what check/explain say must be what the proxy does
    ("passthrough_overlap.yaml", 11, "identities.a.rules[1].passthrough",
     "tunnels the CONNECT"),
    ("method_unknown.yaml", 7, "identities.a.rules[0].methods[1]", "unknown HTTP method 'PSOT'"),
    ("method_star.yaml", 7, "identities.a.rules[0].methods[0]", "unknown HTTP method '*'"),
    ("template_dollar.yaml", 11, "identities.a.rules[0].inject.headers.authorization",
     "template-looking text"),
    ("template_singular.yaml", 11, "identities.a.rules[0].inject.headers.authorization",
     "template-looking text"),
    ("template_half_closed.yaml", 10, "identities.a.rules[0].inject.query.token",
     "template-looking text"),
    ("shadowed_inject.yaml", 9, "identities.a.rules[1]", "never injected"),
    ("psl_wildcard_inject.yaml", 8, "identities.a.rules[0].hosts[1]", "Public Suffix List"),
    ("psl_wildcard_substitute.yaml", 8, "identities.a.rules[0].hosts[0]", "Public Suffix List"),
    ("test_code_on_allow.yaml", 7, "tests[0].code", "only for expect: deny"),
    ("test_inject_on_deny.yaml", 9, "tests[0].inject", "refused request injects nothing"),
    ("test_inject_undeclared.yaml", 9, "tests[0].inject[0]", "secret 'ss' is not declared"),
    ("test_connect_bad.yaml", 7, "tests[0].request", "CONNECT host:port"),
    ("test_passthrough_not_connect.yaml", 7, "tests[0].passthrough", "CONNECT"),
    # public: true
    ("public_and_hosts.yaml", 7, "identities.a.rules[0].public", "not both"),
    ("public_inject.yaml", 10, "identities.a.rules[0].inject", "cannot inject credentials"),
    ("public_substitute.yaml", 9, "identities.a.rules[0].substitute",
     "cannot substitute credentials"),
    ("public_passthrough.yaml", 7, "identities.a.rules[0].passthrough",
     "cannot be passthrough"),
    ("public_private_cidrs.yaml", 7, "identities.a.rules[0].private_cidrs",
     "cannot have private_cidrs"),
    # query:
    ("query_no_values.yaml", 8, "identities.a.rules[0].query.service", "lists no values"),
    ("query_bad_name.yaml", 8, "identities.a.rules[0].query.a&b", "not a plain name"),
    ("query_deny.yaml", 9, "identities.a.rules[1].query", "deny rule cannot match on `query`"),
    ("query_passthrough.yaml", 8, "identities.a.rules[0].passthrough", "cannot also set query"),
    ("query_capitalised.yaml", 8, "identities.a.rules[0].query.Service",
     "matches only 'Service', never 'service'"),
    ("query_plus.yaml", 8, "identities.a.rules[0].query.q", "matches only a client that sends"),
    ("query_optional_no_values.yaml", 8, "identities.a.rules[0].query.page", "lists no values"),
    ("query_absent_deny.yaml", 9, "identities.a.rules[1].query",
     "deny rule cannot match on `query`"),
    # hygiene: rule metadata, owns, pseudo-TLDs (a deny rule may name one; an allow rule not)
    ("rule_expires_bad.yaml", 8, "identities.a.rules[0].expires", "'next friday' is not a date"),
    ("owns_bad_name.yaml", 4, "identities.a.owns", "not a policy file name"),
    ("host_tld_wildcard_allow.yaml", 6, "identities.a.rules[1].hosts[0]", "single label"),
    ("test_tunnel_inject.yaml", 9, "tests[0].inject", "a tunnelled request injects nothing"),
    ("test_gateway_url.yaml", 7, "tests[0].request", "not 'METHOD /PREFIX/PATH'"),
    # max_request_bytes
    ("max_bytes_bad.yaml", 8, "identities.a.rules[0].max_request_bytes",
     "'1.5m' is not a size"),
    ("max_bytes_zero.yaml", 7, "identities.a.rules[0].max_request_bytes", "0 is not a size"),
    ("max_bytes_deny.yaml", 10, "identities.a.rules[1].max_request_bytes",
     "on a deny rule limits nothing"),
    # templates and use:
    ("template_unknown.yaml", 7, "identities.a.use[1]", "unknown template 'git-raed'"),
    ("template_used_twice.yaml", 9, "identities.a.use[1]", "already used by identity 'a'"),
    ("template_not_list.yaml", 3, "templates.git-read", "must be a list of rules"),
    ("template_bad_rule.yaml", 5, "templates.wide[1].hosts[0]", "'*'"),
    ("template_undeclared_secret.yaml", 8, "templates.git[0].substitute[0]",
     "secret 'gth' is not declared"),
    ("template_rule_name_clash.yaml", 10, "identities.a.rules[1].name",
     "rule name 'refs' is used twice"),
    ("template_shadowed_inject.yaml", 11, "identities.a.use[1]",
     "rule 'push' of template 'push'"),
    ("template_own_rule_shadowed.yaml", 11, "identities.a.rules[0]",
     "earlier allow rule 'any-github'"),
]

# Problems only several files make: (fixture dir in broken_multi/, file, line, field, fragment,
# the other place the message names)
BROKEN_MULTI = [
    ("mode_twice", "b.yaml", 5, "identities.x.mode", "`mode` of identity 'x' is also set",
     "a.yaml:4"),
    ("description_twice", "b.yaml", 5, "identities.x.description", "`description` of identity",
     "a.yaml:4"),
    ("narrower_than_twice", "b.yaml", 4, "identities.x.narrower_than",
     "`narrower_than` of identity", "a.yaml:4"),
    ("rule_name_across_files", "b.yaml", 6, "identities.x.rules[1].name",
     "rule name 'r' is used twice", "a.yaml:5"),
    ("template_twice", "b.yaml", 4, "templates.t", "template 't' is also defined", "a.yaml:3"),
    ("passthrough_across_files", "a.yaml", 5, "identities.x.rules[0].passthrough",
     "tunnels the CONNECT", "b.yaml:5"),
    ("owns_other_file", "99-debug.yaml", 5, "identities.agent.rules[0]",
     "only 10-agent.yaml, 20-agent-llm.yaml may add rules", "10-agent.yaml:4"),
]


def _problems(paths: list[Path]) -> list[PolicyProblem]:
    with pytest.raises(PolicyError) as ei:
        load_policy_files(paths)
    return ei.value.problems


@pytest.mark.parametrize(("name", "line", "field", "fragment"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_file(name, line, field, fragment):
    path = FIX / "broken" / name
    problems = _problems([path])
    assert len(problems) == 1, problems
    p = problems[0]
    assert p.file == str(path)
    assert (p.line, p.field) == (line, field)
    assert fragment in p.message
    assert p.fix
    assert str(p).startswith(f"{path}:{line}: ")
    assert "Fix: " in str(p)


def test_every_broken_fixture_is_in_the_table():
    assert {p.name for p in (FIX / "broken").iterdir()} == {b[0] for b in BROKEN}


@pytest.mark.parametrize(("name", "file", "line", "field", "fragment", "other"), BROKEN_MULTI,
                         ids=[b[0] for b in BROKEN_MULTI])
def test_broken_across_files(name, file, line, field, fragment, other):
    d = FIX / "broken_multi" / name
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(d)
    (p,) = ei.value.problems
    assert (p.file, p.line, p.field) == (str(d / file), line, field)
    assert fragment in p.message and str(d / other) in p.message
    assert p.fix and str(p).startswith(f"{d / file}:{line}: ")


def test_every_broken_multi_fixture_is_in_the_table():
    assert {p.name for p in (FIX / "broken_multi").iterdir()} == {b[0] for b in BROKEN_MULTI}


def test_template_shadow_names_the_template_rule():
    (p,) = _problems([FIX / "broken" / "template_shadowed_inject.yaml"])
    assert "template_shadowed_inject.yaml:8" in p.message  # where rule 'push' is written
    assert "rule 'any-github'" in p.message


def test_unknown_template_fix_suggests_name():
    (p,) = _problems([FIX / "broken" / "template_unknown.yaml"])
    assert "did you mean 'git-read'?" in p.fix


def test_vault_without_data_fix_mentions_kv_v1():
    (p,) = _problems([FIX / "broken" / "vault_no_data.yaml"])
    assert "kv_version: 1" in p.fix and "mount" in p.fix


def test_unknown_key_fix_suggests_spelling():
    (p,) = _problems([FIX / "broken" / "unknown_rule_key.yaml"])
    assert "`methods`" in p.fix


def test_undeclared_secret_fix_suggests_name():
    (p,) = _problems([FIX / "broken" / "undeclared_secret.yaml"])
    assert "'anthropic'" in p.fix


def test_yaml_alias_fix_says_quote():
    (p,) = _problems([FIX / "broken" / "yaml_syntax.yaml"])
    assert "'*.example.com'" in p.fix


def test_identity_in_two_files_merges():
    pol = load_policy_files([FIX / "dup_identity" / "one.yaml", FIX / "dup_identity" / "two.yaml"])
    assert set(pol.identities) == {"shared", "other"}
    assert pol.identities["shared"].source == pol.identities["shared"].source.__class__(
        str(FIX / "dup_identity" / "one.yaml"), 3)


def test_duplicate_secret_across_files_names_both():
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(FIX / "dup_secret")
    (p,) = ei.value.problems
    assert (Path(p.file).name, p.line, p.field) == ("two.yaml", 4, "secrets.s")
    assert "one.yaml:3" in p.message


def test_all_errors_collected_across_files(tmp_path):
    (tmp_path / "a.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: r, hosts: ['*'], bogus: 1}\n"
        "      - {name: s, hosts: [x.com], ports: [0]}\n")
    (tmp_path / "b.yaml").write_text("version: v1\nsecrets:\n  s: {vault: kv/x, field: f}\n")
    (tmp_path / "c.yml").write_text("version: v1\nidentities:\n  a: {rules: []}\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    got = {(Path(p.file).name, p.line, p.field) for p in ei.value.problems}
    assert got == {
        ("a.yaml", 5, "identities.a.rules[0].bogus"),
        ("a.yaml", 5, "identities.a.rules[0].hosts[0]"),  # checked despite the unknown key
        ("a.yaml", 6, "identities.a.rules[1].ports[0]"),
        ("b.yaml", 3, "secrets.s.vault"),
    }
    assert len(str(ei.value).splitlines()) == 4


def test_empty_and_missing_directory(tmp_path):
    with pytest.raises(PolicyError, match=r"no \*\.yaml or \*\.yml files"):
        load_policy_dir(FIX / "empty_dir")
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy_dir(tmp_path / "nope")


def test_yaml_tags_are_not_executed(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    assert ei.value.problems[0].line == 2


def test_good_full_compiles():
    pol = load_policy_files([FIX / "good" / "full.yaml"])
    assert set(pol.identities) == {"coding-agent", "bash-tool", "idle"}
    assert pol.identities["idle"].rules == ()
    s = pol.secrets
    assert (s["anthropic"].mount, s["anthropic"].path, s["anthropic"].field,
            s["anthropic"].kv_version) == ("secret", "llm/anthropic", "api_key", 2)
    assert s["anthropic"].placeholder == "sandgate-placeholder-anthropic"
    assert (s["legacy"].mount, s["legacy"].path, s["legacy"].kv_version) == ("kv", "team/legacy", 1)
    assert s["openai"].placeholder == "sk-sandgate-placeholder-openai"
    assert (s["github"].mount, s["github"].path, s["github"].kv_version) == (
        "secret", "ci/github", 2)
    assert pol.placeholders["sk-sandgate-placeholder-openai"] == "openai"

    llm, gh, plain, tunnel, no_admin = pol.identities["coding-agent"].rules
    assert llm.name == "llm" and llm.identity == "coding-agent" and llm.action == "allow"
    assert llm.schemes == {"https"} and llm.ports == {443}
    assert llm.methods == {"POST"}
    assert [h.text for h in llm.hosts] == ["api.anthropic.com"]
    assert [p.text for p in llm.paths or ()] == ["/v1/messages", "/v1/messages/*"]
    assert llm.inject is not None
    ((hname, tmpl),) = llm.inject.headers
    assert hname == "x-api-key" and tmpl.parts == (SecretSlot("anthropic"),)
    assert llm.secrets == {"anthropic"}
    assert llm.source.line == 11 and llm.source.file.endswith("full.yaml")

    assert [h.text for h in gh.hosts] == ["*.github.com", "xn--bcher-kva.example"]
    assert gh.ports == {443, 8443} and gh.methods is None
    assert gh.inject is not None and gh.inject.basic is not None
    assert gh.inject.basic[0].render({}) == "x-access-token"
    assert gh.inject.query[0][1].render({"legacy": "V"}) == "pre-V-post"
    assert gh.secrets == {"github", "legacy", "openai"}
    assert gh.private_cidrs == (ipaddress.ip_network("10.1.2.0/24"),
                                ipaddress.ip_network("fd00::/64"))

    assert plain.schemes == {"http", "https"} and plain.ports == {80, 443}
    assert [h.text for h in plain.hosts] == ["127.0.0.1"]
    assert tunnel.passthrough and tunnel.ports == {5432}
    assert no_admin.action == "deny"
    assert [(t.identity, t.method, t.expect, t.rule) for t in pol.tests] == [
        ("bash-tool", "POST", "deny", None),
        ("coding-agent", "POST", "allow", "llm"),
        ("coding-agent", "GET", "deny", "no-admin"),
    ]


def test_good_multi_merges_sorted_yaml_and_yml_only():
    pol = load_policy_dir(FIX / "good_multi")
    assert [Path(f).name for f in pol.files] == ["10-secrets.yaml", "20-agent.yml"]
    (rule,) = pol.identities["agent"].rules
    assert rule.secrets == {"s"}  # a secret declared in another file
    assert len(pol.tests) == 1


def test_shipped_policies_load():
    pol = load_policy_dir(ROOT / "policies")
    assert {"coding-agent", "web-fetch", "bash-tool"} <= set(pol.identities)
    assert {"anthropic", "openai"} <= set(pol.secrets)


def test_template_whitespace_optional(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "version: v1\nsecrets:\n  s: {vault: secret/data/x, field: k}\nidentities:\n  a:\n"
        "    rules:\n      - name: r\n        hosts: [x.com]\n"
        "        inject: {headers: {A: '{{secrets.s}}', B: 'x {{   secrets.s   }} y'}}\n")
    pol = load_policy_dir(tmp_path)
    inj = pol.identities["a"].rules[0].inject
    assert inj is not None
    assert [(n, t.render({"s": "V"})) for n, t in inj.headers] == [("a", "V"), ("b", "x V y")]


def test_json_schema():
    schema = policy_json_schema()
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {"version", "secrets", "templates", "identities",
                                         "tests", "gateways", "webhooks", "budgets",
                                         "prices"}
    assert schema["$defs"]["GatewaySpec"]["required"] == ["prefix", "upstream", "token_header"]
    assert schema["$defs"]["RuleSpec"]["additionalProperties"] is False
    assert schema["$defs"]["RuleSpec"]["required"] == ["name"]  # hosts, or public: true
    rule = schema["$defs"]["RuleSpec"]["properties"]
    for key in ("public", "query", "max_request_bytes"):
        assert rule[key]["description"]
    assert schema["$defs"]["IdentitySpec"]["properties"]["use"]["description"]
    assert schema["properties"]["templates"]["description"]


# --- soundness: load errors for policies that would not do what they say --------------------


def _load_rules(tmp_path: Path, rules: str, secrets: str = "", name: str = "p.yaml"):
    (tmp_path / name).write_text(
        "version: v1\n" + (f"secrets:\n{secrets}" if secrets else "")
        + "identities:\n  a:\n    rules:\n" + rules)
    return load_policy_dir(tmp_path)


@pytest.mark.parametrize(("intercepted", "tunnel"), [
    ("{name: i, hosts: [api.x.com], paths: [/r/**]}", "{name: t, hosts: [api.x.com], "
     "passthrough: true}"),  # exact / exact
    ("{name: i, hosts: [api.x.com], methods: [GET]}", "{name: t, hosts: ['*.x.com'], "
     "passthrough: true}"),  # wildcard covers exact
    ("{name: i, hosts: ['*.a.x.com'], methods: [GET]}", "{name: t, hosts: ['*.x.com'], "
     "passthrough: true}"),  # nested wildcards
    ("{name: i, hosts: ['*.x.com'], methods: [GET]}", "{name: t, hosts: [a.b.x.com], "
     "ports: [443, 8443], passthrough: true}"),  # either order, ports intersect
])
def test_passthrough_overlapping_intercepted_allow_is_refused(tmp_path, intercepted, tunnel):
    for order in ((intercepted, tunnel), (tunnel, intercepted)):
        with pytest.raises(PolicyError) as ei:
            _load_rules(tmp_path, "".join(f"      - {r}\n" for r in order))
        (p,) = ei.value.problems
        assert p.field.endswith(".passthrough") and "tunnels the CONNECT" in p.message
        assert "rule 'i'" in p.message and "Fix: " in str(p)


@pytest.mark.parametrize("other", [
    "{name: i, hosts: [api.y.com], methods: [GET]}",  # other host
    "{name: i, hosts: [api.x.com], ports: [8443], methods: [GET]}",  # other port
    "{name: i, hosts: [x.com], methods: [GET]}",  # apex is not under *.x.com
])
def test_passthrough_next_to_disjoint_intercepted_allow_loads(tmp_path, other):
    _load_rules(tmp_path, f"      - {other}\n"
                "      - {name: t, hosts: ['*.x.com'], passthrough: true}\n")


def test_passthrough_overlap_other_identity_is_fine(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n"
        "  a: {rules: [{name: i, hosts: [api.x.com], methods: [GET]}]}\n"
        "  b: {rules: [{name: t, hosts: [api.x.com], passthrough: true}]}\n")
    load_policy_dir(tmp_path)


def test_registered_methods_are_accepted_and_unknown_fix_lists_them(tmp_path):
    pol = _load_rules(tmp_path, "      - {name: r, hosts: [x.com], methods: [get, PROPFIND, "
                      "MKCOL, patch, Options]}\n")
    assert pol.identities["a"].rules[0].methods == {"GET", "PROPFIND", "MKCOL", "PATCH",
                                                    "OPTIONS"}
    (p,) = _problems([FIX / "broken" / "method_unknown.yaml"])
    assert "did you mean POST" in p.fix and "GET, HEAD, POST" in p.fix
    (p,) = _problems([FIX / "broken" / "method_star.yaml"])
    assert "leave out `methods`" in p.fix


@pytest.mark.parametrize("name", ["template_dollar.yaml", "template_singular.yaml",
                                  "template_half_closed.yaml"])
def test_template_typo_fix_names_the_slot(name):
    (p,) = _problems([FIX / "broken" / name])
    assert "{{ secrets.gh }}" in p.fix


def test_shadowed_rule_without_secrets_loads(tmp_path):
    pol = _load_rules(tmp_path, "      - {name: wide, hosts: ['*.x.com']}\n"
                      "      - {name: narrow, hosts: [api.x.com], methods: [GET]}\n")
    assert len(pol.identities["a"].rules) == 2


@pytest.mark.parametrize(("earlier", "shadowed"), [
    ("{name: e, hosts: [api.x.com]}", True),
    ("{name: e, hosts: [api.x.com], methods: [GET, POST]}", True),
    ("{name: e, hosts: [api.x.com], paths: ['/v1/**']}", True),
    ("{name: e, hosts: [api.x.com], paths: ['/v1/*/y']}", True),
    ("{name: e, hosts: [api.x.com], methods: [GET]}", False),
    ("{name: e, hosts: [api.x.com], paths: ['/v2/**']}", False),
    ("{name: e, hosts: [api.x.com], paths: ['/v1/x/y']}", False),
    ("{name: e, hosts: [api.x.com], ports: [8443]}", False),
    ("{name: e, hosts: [api.x.com], passthrough: true, ports: [8443]}", False),
    ("{name: e, action: deny, hosts: [api.x.com], paths: ['/admin/**']}", False),
])
def test_shadowed_injecting_rule_is_an_error(tmp_path, earlier, shadowed):
    rules = (f"      - {earlier}\n"
             "      - {name: inj, hosts: [api.x.com], methods: [POST], paths: ['/v1/*/y'], "
             "substitute: [s]}\n")
    secrets = "  s: {vault: secret/data/s, field: k}\n"
    if not shadowed:
        _load_rules(tmp_path, rules, secrets)
        return
    with pytest.raises(PolicyError) as ei:
        _load_rules(tmp_path, rules, secrets)
    (p,) = ei.value.problems
    assert p.field == "identities.a.rules[1]" and "rule 'e'" in p.message
    assert "first matching allow" in p.message


@pytest.mark.parametrize("host", ["*.co.uk", "*.github.io", "*.amazonaws.com",
                                  "*.googleapis.com", "*.s3.amazonaws.com"])
def test_public_suffix_wildcard_on_injecting_rule(tmp_path, host):
    with pytest.raises(PolicyError) as ei:
        _load_rules(tmp_path, f"      - {{name: r, hosts: ['{host}'], substitute: [s]}}\n",
                    "  s: {vault: secret/data/s, field: k}\n")
    (p,) = ei.value.problems
    assert "Public Suffix List" in p.message and host in p.message


@pytest.mark.parametrize("host", ["*.github.com", "*.example.co.uk", "*.wikipedia.org",
                                  "*.bucket.s3.amazonaws.com"])
def test_registrable_wildcard_on_injecting_rule_loads(tmp_path, host):
    _load_rules(tmp_path, f"      - {{name: r, hosts: ['{host}'], substitute: [s]}}\n",
                "  s: {vault: secret/data/s, field: k}\n")


def test_public_suffix_wildcard_without_secrets_loads(tmp_path):
    _load_rules(tmp_path, "      - {name: r, hosts: ['*.github.io'], methods: [GET]}\n")


def test_policy_file_names(tmp_path):
    from sandgate.policy.loader import discover_policy_files

    rule = "      - {name: r, hosts: [x.com]}\n"
    _load_rules(tmp_path, rule, name="A.YAML")
    for name in ("b.yaml.new", "c.yml~", ".hidden.yaml", "notes.txt"):
        (tmp_path / name).write_text("version: v1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.yaml").write_text("version: v1\n")
    read, skipped = discover_policy_files(tmp_path)
    assert [p.name for p in read] == ["A.YAML"]
    why = {Path(f).name: r for f, r in skipped}
    assert set(why) == {"b.yaml.new", "c.yml~", ".hidden.yaml", "notes.txt", "sub"}
    assert "subfolder" in why["sub"] and "hidden" in why[".hidden.yaml"]
    assert ".yaml" in why["b.yaml.new"]
    pol = load_policy_dir(tmp_path)
    assert [Path(f).name for f in pol.files] == ["A.YAML"]


def test_schema_describes_fixture_keys():
    test = policy_json_schema()["$defs"]["TestSpec"]["properties"]
    for key in ("request", "expect", "rule", "inject", "code", "passthrough"):
        assert test[key].get("description"), key


SHARED = "version: v1\nsecrets:\n  k: {vault: secret/data/k, field: f}\n" \
    "templates:\n  t:\n    - name: r\n      hosts: [a.example.com]\n" \
    "      description: clone over smart HTTP: read only\n"
USER = "version: v1\nidentities:\n  a:\n    use: [t]\n    rules:\n" \
    "      - {name: x, hosts: [b.example.com], inject: {headers: {k: '{{ secrets.k }}'}}}\n" \
    "tests:\n  - {identity: a, request: GET https://b.example.com/, expect: allow, inject: [k]}\n"


def test_a_colon_in_a_plain_value_is_named_once_without_a_cascade(tmp_path):
    """issue 38: the error did not name the `: ` in a plain value, and every file referring to
    what the broken file defines reported it missing (25 problems for one line)."""
    (tmp_path / "10-shared.yaml").write_text(SHARED)
    (tmp_path / "20-a.yaml").write_text(USER)
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    (p,) = ei.value.problems
    assert (Path(p.file).name, p.line) == ("10-shared.yaml", 8)
    assert "`description` contains ': '" in p.message
    assert 'quote the value: description: "clone over smart HTTP: read only"' in p.fix
    # the fix, applied, loads
    (tmp_path / "10-shared.yaml").write_text(SHARED.replace(
        "description: clone over smart HTTP: read only",
        'description: "clone over smart HTTP: read only"'))
    assert load_policy_dir(tmp_path).identities["a"].rules


def test_a_colon_in_a_flow_value_is_named(tmp_path):
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: r, hosts: [a.example.com], description: see: the wiki, methods: [GET]}\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    (p,) = ei.value.problems
    assert p.line == 5 and 'quote the value: description: "see: the wiki"' in p.fix


def test_two_broken_files_give_one_root_error_each(tmp_path):
    (tmp_path / "a.yaml").write_text("version: v1\nidentities:\n  a: {rules: [}\n")
    (tmp_path / "b.yaml").write_text("version: v1\nsecrets:\n  s: x: y\n")
    (tmp_path / "c.yaml").write_text(USER)
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    assert [Path(p.file).name for p in ei.value.problems] == ["a.yaml", "b.yaml"]
    assert "YAML syntax error" in ei.value.problems[0].message

_WORD = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E,
                              blacklist_characters="#:'\"{}[],&*!|>%@`\\-?"), min_size=1,
                max_size=8)


@settings(max_examples=150, deadline=None)
@given(st.lists(_WORD, min_size=2, max_size=4), st.sampled_from(['"', "\\", "x"]))
def test_the_quoted_fix_reads_back_the_value_meant(words, extra):
    """Whatever plain value holds a `: `, the fix offered is YAML for exactly that value."""
    import yaml

    from sandgate.policy.loader import _plain_colon

    value = ": ".join(words) + extra
    text = f"a:\n  reason: {value}\n"
    try:
        yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        got = _plain_colon(text, e)
        assert got is not None
        key, _, fix = got
        assert key == "reason"
        fixed = fix.removeprefix("quote the value: ")
        assert yaml.safe_load(f"a:\n  {fixed}\n") == {"a": {"reason": value}}
    else:
        raise AssertionError(f"{text!r} loaded")
