"""`sandgate lint`, semantic classes: one planted mistake per case, each beside a legitimate
near-miss that must lint clean. Every warning must be located (file:line, field) and carry a
fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandgate.review.lint import lint_dir

pytestmark = pytest.mark.unit

SECRETS = ("version: v1\nsecrets:\n"
           "  gh: {vault: secret/data/gh, field: token}\n"
           "  ghw: {vault: secret/data/ghw, field: token}\n")
ALLOW_FIX = "  - {identity: a, request: GET https://api.example.com/x, expect: allow}\n"


def policy(rules: str, tests: str = "", extra: str = "", head: str = SECRETS) -> str:
    used = ("      - {name: used, hosts: [gh.example.com], methods: [GET], substitute: [gh, ghw]}"
            "\n")
    return (head + extra + "identities:\n  a:\n    rules:\n" + used + rules
            + "tests:\n" + ALLOW_FIX.replace("api.example.com/x", "gh.example.com/") + tests)


def lint(tmp_path: Path, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return lint_dir(tmp_path)


R = "      - "
WEB = R + "{name: web, hosts: [api.example.com], methods: [GET, HEAD]}\n"

# (case id, files, expected substring of the message or None for a near-miss that lints clean)
CASES: list[tuple[str, dict[str, str], str | None]] = [
    # --- a deny that covers less than it looks
    ("star-for-doublestar", {"p.yaml": policy(
        WEB + R + "{name: no-admin, action: deny, hosts: [api.example.com], paths: [/admin/*]}\n")},
     "does not match /admin"),
    ("star-for-doublestar-ok", {"p.yaml": policy(
        WEB + R + "{name: no-admin, action: deny, hosts: [api.example.com], "
        "paths: [/admin/**]}\n")}, None),
    ("trailing-slash", {"p.yaml": policy(
        WEB + R + "{name: no-admin, action: deny, hosts: [api.example.com], "
        "paths: [/admin/, '/admin;*/']}\n")}, "path /admin/ does not match /admin"),
    ("deny-ports", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com], methods: [GET], ports: [443, 8443]}\n"
        + R + "{name: no-all, action: deny, hosts: [api.example.com]}\n")},
     "also allows https on port 8443"),
    ("deny-schemes", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com], methods: [GET], schemes: [http, https]}\n"
        + R + "{name: no-all, action: deny, hosts: [api.example.com]}\n")},
     "also allows http on port 80"),
    ("deny-ports-ok", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com], methods: [GET], ports: [443, 8443]}\n"
        + R + "{name: no-all, action: deny, hosts: [api.example.com], ports: [443, 8443]}\n")},
     None),
    ("get-not-head", {"p.yaml": policy(
        WEB + R + "{name: no-get, action: deny, hosts: [api.example.com], methods: [GET]}\n")},
     "denies GET but not HEAD"),
    ("delete-only-ok", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com], methods: [GET, DELETE]}\n"
        + R + "{name: no-delete, action: deny, hosts: [api.example.com], methods: [DELETE]}\n")},
     None),
    ("wildcard-beside-apex", {"p.yaml": policy(
        R + "{name: web, hosts: [example.com, '*.example.com'], methods: [GET]}\n"
        + R + "{name: no-sub, action: deny, hosts: ['*.example.com']}\n")},
     "does not match the apex example.com"),
    ("wildcard-without-apex-ok", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com, www.example.com], methods: [GET]}\n"
        + R + "{name: no-www, action: deny, hosts: ['*.example.com'], methods: [GET]}\n")},
     None),
    ("name-denied-public", {"p.yaml": policy(
        R + "{name: no-evil, action: deny, hosts: [evil.example.com]}\n"
        + R + "{name: web, public: true, methods: [GET]}\n")},
     "but not its subdomains"),
    # issue 38: a web-reading identity denying sites by name (and their subdomains) next to
    # `public: true` is as good as names get: lint-clean (main: "same servers by IP address")
    ("name-denied-public-ok", {"p.yaml": policy(
        R + "{name: no-evil, action: deny, hosts: [evil.example.com, '*.evil.example.com']}\n"
        + R + "{name: web, public: true, methods: [GET]}\n")}, None),
    # issue 38: GitHub does not strip `;` parameters: no Java warning for its rules, and the
    # one-name `*` segments of a GitHub deny are not "`*` where `**` was meant" (whose fix
    # `/repos/**/hooks` would also deny a repository named hooks)
    ("github-deny-ok", {"p.yaml": policy(
        R + "{name: gh, hosts: [api.github.com], methods: [GET, POST], paths: [/repos/**]}\n"
        + R + "{name: no-hooks, action: deny, hosts: [api.github.com], "
        "paths: [/repos/*/*/hooks, /repos/*/*/hooks/**, /repos/acme/secret, "
        "/repos/acme/secret/**]}\n")},
     None),
    ("deny-paths-outside-allow", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com], methods: [GET], paths: [/v1/**]}\n"
        + R + "{name: no-admin, action: deny, hosts: [api.example.com], paths: [/admin/**]}\n")},
     "no request an allow rule lets through matches its paths"),
    ("matrix-param", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com], methods: [GET], paths: [/a/**]}\n"
        + R + "{name: no-secret, action: deny, hosts: [api.example.com], paths: [/a/secret]}\n")},
     "Java servers"),
    ("dotdot-semicolon", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com], methods: [GET], paths: [/b/**, /admin]}\n"
        + R + "{name: no-admin, action: deny, hosts: [api.example.com], "
        "paths: [/admin, '/admin;*']}\n")},
     "`..;`"),
    ("matrix-ok", {"p.yaml": policy(
        R + "{name: web, hosts: [api.example.com], methods: [GET], paths: [/a/public/**]}\n"
        + R + "{name: no-secret, action: deny, hosts: [api.example.com], "
        "paths: [/a/public/secret/**, '/a/public/secret;*/**', '/**/..;*/**']}\n")}, None),
    # --- partial overlaps
    ("read-token-on-writes", {"p.yaml": policy(
        R + "{name: read, hosts: [api.example.com], methods: [GET, POST], paths: [/repos/**],"
        " substitute: [gh]}\n"
        + R + "{name: write, hosts: [api.example.com], methods: [POST, PATCH], "
        "paths: [/repos/**], substitute: [ghw]}\n")},
     "is sent with secrets gh instead of secrets ghw"),
    ("specific-before-general-ok", {"p.yaml": policy(
        R + "{name: acme, hosts: [api.example.com], methods: [GET], paths: [/repos/acme/**],"
        " substitute: [ghw]}\n"
        + R + "{name: rest, hosts: [api.example.com], methods: [GET], paths: [/repos/**],"
        " substitute: [gh]}\n")}, None),
    # mcp:/jsonrpc: rules: a rule decides only the calls its filter allows
    ("mcp-disjoint-calls-ok", {"p.yaml": policy(
        R + "{name: read, hosts: [mcp.example.com], methods: [POST], paths: [/mcp, /mcp/**],"
        " mcp: {tools: ['get_*']}, substitute: [gh]}\n"
        + R + "{name: write, hosts: [mcp.example.com], methods: [POST], paths: [/mcp],"
        " mcp: {methods: [tools/call], tools: [create_issue]}, substitute: [ghw]}\n")}, None),
    ("mcp-shared-call", {"p.yaml": policy(
        R + "{name: read, hosts: [mcp.example.com], methods: [POST], paths: [/mcp, /mcp/**],"
        " mcp: {tools: ['get_*']}, substitute: [gh]}\n"
        + R + "{name: write, hosts: [mcp.example.com], methods: [POST], paths: [/mcp],"
        " mcp: {tools: [create_issue]}, substitute: [ghw]}\n")},
     "carrying method initialize is sent with secrets gh instead of secrets ghw"),
    ("mcp-fixture-judged-with-its-call", {"p.yaml": policy(
        R + "{name: mcp, hosts: [mcp.example.com], methods: [POST], paths: [/mcp, /mcp/**],"
        " mcp: {tools: ['get_*']}}\n"
        + R + "{name: no-admin, action: deny, hosts: [mcp.example.com], paths: [/mcp/admin]}\n",
        "  - {identity: a, request: POST https://mcp.example.com/mcp, mcp: {tool: drop},"
        " expect: deny}\n")}, "is refused by no_rule, not by deny rule 'no-admin'"),
    ("query-then-unconstrained", {"p.yaml": policy(
        R + "{name: refs, hosts: [git.example.com], methods: [GET], paths: ['/*/info/refs'],"
        " query: {service: [git-upload-pack]}, substitute: [gh]}\n"
        + R + "{name: any, hosts: [git.example.com], methods: [GET]}\n",
        "  - {identity: a, request: 'GET https://git.example.com/r/info/refs?service=git-upload-"
        "pack', expect: allow}\n")},
     "allows only some values of service"),
    ("query-then-other-paths-ok", {"p.yaml": policy(
        R + "{name: refs, hosts: [git.example.com], methods: [GET], paths: ['/*/info/refs'],"
        " query: {service: [git-upload-pack]}, substitute: [gh]}\n"
        + R + "{name: push, hosts: [git.example.com], methods: [GET], paths: "
        "['/pushable/info/refs'], query: {service: [git-receive-pack]}}\n")}, None),
    ("prefix-glob", {"p.yaml": policy(
        R + "{name: acme, hosts: [api.example.com], methods: [GET], paths: ['/repos/acme*/**']}"
        "\n")}, "'acme-evil'"),
    ("prefix-glob-boundary-ok", {"p.yaml": policy(
        R + "{name: acme, hosts: [api.example.com], methods: [GET], "
        "paths: ['/repos/acme-*/**', '/files/*.tar.gz']}\n")}, None),
    # --- over-broad grants
    ("metadata-cidr", {"p.yaml": policy(
        R + "{name: int, hosts: [svc.corp.test], methods: [GET], private_cidrs: [169.254.0.0/16]}"
        "\n")}, "metadata address 169.254.169.254"),
    ("metadata-cidr-v6", {"p.yaml": policy(
        R + "{name: int, hosts: [svc.corp.test], methods: [GET], private_cidrs: ['fd00::/8']}"
        "\n")}, "metadata address fd00:ec2::254"),
    ("private-cidr-ok", {"p.yaml": policy(
        R + "{name: int, hosts: [svc.corp.test, 10.1.2.3], methods: [GET], "
        "private_cidrs: [10.0.0.0/8]}\n")}, None),
    ("private-ip-no-cidrs", {"p.yaml": policy(
        R + "{name: int, hosts: [10.1.2.3], methods: [GET]}\n")}, "is a private address"),
    ("secret-hosts-wildcard", {"p.yaml": policy("", head=SECRETS.replace(
        "field: token}\n  ghw", "field: token, hosts: ['*.example.com']}\n  ghw"))},
     "may be sent to any host under *.example.com"),
    ("secret-hosts-exact-ok", {"p.yaml": policy("", head=SECRETS.replace(
        "field: token}\n  ghw", "field: token, hosts: [gh.example.com]}\n  ghw"))}, None),
    ("drive-by-file-widens", {
        "10-a.yaml": policy(WEB),
        "99-debug.yaml": "version: v1\nidentities:\n  a:\n    rules:\n"
                         "      - {name: debug, public: true, methods: [GET]}\n"},
     "this file widens identity 'a'"),
    ("drive-by-file-report-mode", {
        "10-a.yaml": policy(WEB),
        "99-debug.yaml": "version: v1\nidentities:\n  a:\n    mode: report\n"},
     "to `mode: report`"),
    ("drive-by-file-uses-template", {
        "10-a.yaml": policy(WEB, extra="templates:\n  wide:\n"
                            "    - {name: any, hosts: [files.example.com], methods: [GET]}\n"
                            "  plain:\n"
                            "    - {name: plain, hosts: [api.example.com], methods: [GET]}\n")
        .replace("  a:\n    rules:", "  a:\n    use: [plain]\n    rules:"),
        "99-debug.yaml": "version: v1\nidentities:\n  a:\n    use: [wide]\n"},
     "this file widens identity 'a'"),
    ("other-file-narrows-ok", {
        "10-a.yaml": policy(WEB),
        "99-deny.yaml": "version: v1\nidentities:\n  a:\n    rules:\n"
                        "      - {name: no-admin, action: deny, hosts: [api.example.com], "
                        "paths: [/admin/**, '/admin;*/**', '/**/..;*/**']}\n"}, None),
    # --- proofs and fixtures that hold for the wrong reason
    ("report-mode-proof", {"p.yaml": policy(WEB).replace(
        "identities:\n  a:\n", "identities:\n  b:\n    mode: report\n    narrower_than: a\n"
        "    rules:\n      - {name: web, hosts: [api.example.com], methods: [GET]}\n  a:\n")
        + "  - {identity: b, request: GET https://api.example.com/, expect: allow}\n"},
     "mode: report"),
    ("deny-fixture-unpinned", {"p.yaml": policy(
        WEB + R + "{name: no-admin, action: deny, hosts: [api.example.com], methods: [GET],"
        " paths: [/admin]}\n",
        "  - {identity: a, request: POST https://api.example.com/admin, expect: deny}\n")},
     "not by deny rule 'no-admin'"),
    ("deny-fixture-pinned-ok", {"p.yaml": policy(
        WEB + R + "{name: no-admin, action: deny, hosts: [api.example.com], methods: [GET, "
        "HEAD], paths: [/admin/**, '/admin;*/**', '/**/..;*/**']}\n",
        "  - {identity: a, request: GET https://api.example.com/admin/x, expect: deny, "
        "rule: no-admin}\n")}, None),
    ("fixture-host-typo", {"p.yaml": policy(
        WEB, "  - {identity: a, request: POST https://api.exmple.com/x, expect: deny}\n")},
     "named by no rule, but api.example.com is"),
    ("fixture-wrong-host-for-deny", {"p.yaml": policy(
        WEB + R + "{name: no-admin, action: deny, hosts: [api.example.com], "
        "paths: [/admin/**]}\n",
        "  - {identity: a, request: GET https://admin.internal.test/admin/users, "
        "expect: deny}\n")}, "looks written for deny rule 'no-admin'"),
    ("fixture-unknown-host-ok", {"p.yaml": policy(
        WEB, "  - {identity: a, request: GET https://api.example.com.evil.test/, "
        "expect: deny}\n")}, None),
    ("fixture-inside-passthrough", {"p.yaml": policy(
        R + "{name: db, hosts: [db.example.com], ports: [5432], passthrough: true}\n",
        "  - {identity: a, request: GET https://db.example.com:5432/x, expect: deny}\n")},
     "tunnels uninspected"),
    ("connect-fixture-passthrough-ok", {"p.yaml": policy(
        R + "{name: db, hosts: [db.example.com], ports: [5432], passthrough: true}\n",
        "  - {identity: a, request: CONNECT db.example.com:5432, expect: allow, "
        "passthrough: true}\n")}, None),
    # --- gateways
    ("gateway-unreached", {"p.yaml": policy(WEB, extra=(
        "gateways:\n  - {prefix: /llm, upstream: 'https://llm.example.com', "
        "token_header: authorization}\n"))}, "which no allow rule of any identity reaches"),
    ("gateway-token-header", {"p.yaml": policy(
        R + "{name: llm, hosts: [llm.example.com], methods: [POST], "
        "inject: {headers: {x-api-key: '{{ secrets.gh }}'}}}\n", extra=(
            "gateways:\n  - {prefix: /llm, upstream: 'https://llm.example.com', "
            "token_header: authorization}\n"))}, "inject x-api-key"),
    ("gateway-prefix-names-other", {"p.yaml": policy(
        R + "{name: llm, hosts: [llm.example.com], methods: [POST], "
        "inject: {headers: {x-api-key: '{{ secrets.gh }}'}}}\n"
        + R + "{name: other, hosts: [openai.example.net], methods: [POST], "
        "inject: {headers: {authorization: 'Bearer {{ secrets.ghw }}'}}}\n", extra=(
            "gateways:\n  - {prefix: /openai, upstream: 'https://llm.example.com', "
            "token_header: x-api-key}\n"))}, "names 'openai'"),
    ("gateway-ok", {"p.yaml": policy(
        R + "{name: llm, hosts: [llm.example.com], methods: [POST], "
        "inject: {headers: {x-api-key: '{{ secrets.gh }}'}}}\n", extra=(
            "gateways:\n  - {prefix: /llm, upstream: 'https://llm.example.com', "
            "token_header: [x-api-key, authorization]}\n"))}, None),
    # --- query values
    ("query-camelcase-twin", {"p.yaml": policy(
        R + "{name: refs, hosts: [git.example.com], methods: [GET], "
        "query: {pageSize: ['10']}}\n"
        "      - {name: refs2, hosts: [git.example.com], methods: [GET], "
        "query: {pagesize: ['10']}}\n")}, "is matched exactly"),
    ("query-camelcase-ok", {"p.yaml": policy(
        R + "{name: s, hosts: [api.example.com], methods: [GET], "
        "query: {pageSize: ['10', '100'], q: [a b]}}\n")}, None),
]


@pytest.mark.parametrize(("files", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_semantic_lint(tmp_path, files, expected):
    found = lint(tmp_path, files)
    if expected is None:
        assert [str(f) for f in found] == []
        return
    hits = [f for f in found if expected in f.message]
    assert hits, [str(f) for f in found]
    for f in hits:
        assert Path(f.file).parent == tmp_path and f.line > 1 and f.fix
        assert f.field


def test_shipped_and_good_policies_stay_clean():
    root = Path(__file__).parents[2]
    assert lint_dir(root / "policies") == []
    assert lint_dir(root / "tests/integration/clients/policies") == []
