"""The codes of `sandgate lint` warnings: one per kind of mistake, shown with each warning
(`[code]`), in `--format json`, and the names a rule's `lint: {ignore: [CODE], why: ...}`
may suppress (an unknown code there is a load error). docs/policy-review.md lists them."""

from __future__ import annotations

CODES: dict[str, str] = {
    # structure (sandgate.review.lint)
    "skipped-file": "a policy-looking file in the directory is not read",
    "no-fixture": "an identity no fixture names",
    "unused-secret": "a secret no rule references",
    "unused-template": "a template no identity uses",
    "template-text": "template-looking text outside an inject template",
    "expires-soon": "a rule expires within a week",
    "public-suffix-wildcard": "a wildcard over a public suffix on a rule without secrets",
    "secret-any-method": "a rule sends secrets for any method",
    "secret-any-path": "a rule sends secrets for any path ('/**')",
    "shadowed-rule": "an allow rule an earlier allow rule hides",
    "after-public": "an allow rule after a `public: true` rule it overlaps",
    "deny-never-applies": "a deny rule no allow rule's request reaches",
    # a deny that covers less than it looks (sandgate.review.lint_semantic)
    "deny-star-segment": "a deny path ending in `*` where `/**` was meant",
    "deny-trailing-slash": "a deny path with (without) a trailing slash",
    "deny-ports": "a deny rule missing some of the allow rule's schemes or ports",
    "deny-get-head": "GET denied but HEAD passes (or the reverse)",
    "deny-apex": "a `*.domain` deny beside an allowed apex",
    "deny-under-public": "a name denied under `public: true` whose subdomains pass",
    "java-path-params": "`;` path parameters a Java server strips pass a deny",
    # rules that take each other's requests
    "overlap-secrets": "an earlier rule with other secrets decides some requests",
    "query-catch-all": "a `query:` rule with a later rule allowing other values",
    "prefix-glob": "a path glob `acme*` that also matches `acme-evil`",
    # over-broad grants
    "metadata-cidr": "private_cidrs containing a cloud metadata address",
    "private-literal": "a private IP literal the address step refuses",
    "secret-host-wildcard": "a wildcard in a secret's hosts",
    "widening-file": "a file other than the identity's own widens it",
    # proofs, fixtures, gateways, query values
    "report-mode-proof": "narrower_than on an identity in mode: report",
    "fixture-deny-unpinned": "expect: deny without rule: or code: for a denied host",
    "fixture-near-host": "a fixture host one or two edits from a rule's host",
    "fixture-wrong-host": "a fixture written for a deny rule's path on a host no rule names",
    "fixture-tunnelled": "a fixture request inside a passthrough tunnel",
    "gateway-unreached": "a gateway whose upstream no rule reaches",
    "gateway-token-header": "a gateway token_header the rules do not inject",
    "gateway-prefix-host": "a gateway prefix naming another host",
    "query-name-case": "a query parameter name with capitals",
    # action: ask and webhooks (sandgate.review.lint_ask)
    "ask-never-asks": "an ask rule a deny rule covers",
    "ask-hides-allow": "an allow rule an ask rule covers",
    "ask-hold-timeout": "a hold longer than the proxy's idle timeout",
    "unused-webhook": "a webhook no ask rule names",
    # MCP tools and arguments (sandgate.review.lint_mcp, lint_calls)
    "mcp-bypass": "a rule without `mcp:` on an MCP host takes calls the tool rules judge",
    "mcp-tools-any": "a rule allowing any tool beside rules that list tools",
    "mcp-tool-glob": "a tool glob matching more tools the server lists than named",
    "mcp-tool-unlisted": "a `tools` entry matching no tool the server lists",
    "mcp-deny-unmatched": "a `deny_tools` entry matching no tool (listed or allowed)",
    "mcp-argument-glob": "an argument glob `acme*` that also matches `acme-evil`",
    # DNS (sandgate.review.lint_mcp)
    "dns-type-widening": "extra `dns.types` on a wildcard or package-index rule",
    "dns-public": "`public: true` in a policy written for the policy DNS",
    # review (sandgate.review.lint_mcp)
    "owns-template": "a template used by an `owns:` identity, defined outside its files",
    "grant-no-expiry": "a temporary-looking grant without `expires`",
    "grant-no-owner": "an expiring grant without `owner`",
    "lint-ignore-unused": "a `lint: ignore` entry that suppresses nothing",
}
