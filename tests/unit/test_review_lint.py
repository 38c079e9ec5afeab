"""`sandgate lint`: warnings for policies that load but may not do what their authors mean."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandgate.review.lint import lint_dir

ROOT = Path(__file__).parents[2]

HEAD = ("version: v1\nsecrets:\n  gh: {vault: secret/data/gh, field: token}\n"
        "identities:\n  a:\n    rules:\n")
USE_GH = "      - {name: use, hosts: [api.github.com], methods: [GET], substitute: [gh]}\n"
FIXTURE = "tests:\n  - {identity: a, request: GET https://api.github.com/, expect: allow}\n"


def _lint(tmp_path: Path, rules: str, tail: str = FIXTURE, head: str = HEAD):
    (tmp_path / "p.yaml").write_text(head + rules + tail)
    return lint_dir(tmp_path)


def _msgs(findings) -> list[str]:
    return [f.message for f in findings]


def test_clean(tmp_path):
    assert _lint(tmp_path, USE_GH) == []


def test_shipped_policies_clean():
    assert lint_dir(ROOT / "policies") == []


@pytest.mark.parametrize("host", ["*.github.io", "*.co.uk", "*.amazonaws.com"])
def test_public_suffix_wildcard(tmp_path, host):
    (f,) = _lint(tmp_path, USE_GH + f"      - {{name: r, hosts: ['{host}'], methods: [GET]}}\n")
    assert "Public Suffix List" in f.message and f.line == 8
    assert f.field == "identities.a.rules[1].hosts[0]" and f.fix


def test_injecting_rule_without_methods_or_with_any_path(tmp_path):
    fs = _lint(tmp_path, "      - {name: use, hosts: [api.github.com], substitute: [gh]}\n"
               "      - {name: use2, hosts: [uploads.github.com], methods: [POST],"
               " paths: ['/**'], substitute: [gh]}\n")
    assert [f.field for f in fs] == ["identities.a.rules[0]", "identities.a.rules[1].paths[0]"]
    assert "any method" in fs[0].message and "any path" in fs[1].message


def test_shadowed_rule(tmp_path):
    (f,) = _lint(tmp_path, USE_GH + "      - {name: wide, hosts: ['*.github.com']}\n"
                 "      - {name: narrow, hosts: [gist.github.com], methods: [GET]}\n")
    assert f.field == "identities.a.rules[2]" and "'wide'" in f.message
    assert "first matching allow" in f.message


@pytest.mark.parametrize(("deny", "dead"), [
    ("{name: d, action: deny, hosts: [api.github.com], paths: [/admin/**]}", False),
    ("{name: d, action: deny, hosts: ['*.github.com']}", False),
    ("{name: d, action: deny, hosts: [api.github.com], ports: [8443]}", True),
    ("{name: d, action: deny, hosts: [api.github.com], schemes: [http]}", True),
    ("{name: d, action: deny, hosts: [api.github.com], methods: [DELETE]}", True),
    ("{name: d, action: deny, hosts: [gitlab.com]}", True),
])
def test_deny_rule_that_never_applies(tmp_path, deny, dead):
    fs = _lint(tmp_path, USE_GH + f"      - {deny}\n")
    if not dead:
        assert fs == []
        return
    (f,) = fs
    assert "never applies" in f.message and f.field == "identities.a.rules[1]"


def test_unused_secret(tmp_path):
    (f,) = _lint(tmp_path, "      - {name: r, hosts: [api.github.com], methods: [GET]}\n")
    assert f.field == "secrets.gh" and "never referenced" in f.message and f.line == 3


def test_template_looking_text_anywhere(tmp_path):
    head = HEAD.replace("  a:\n", "  a:\n    description: 'uses ${GITHUB_TOKEN}'\n")
    (f,) = _lint(tmp_path, USE_GH, head=head)
    assert f.field == "identities.a.description" and "template-looking" in f.message
    assert f.line == 6


def test_identity_without_fixture(tmp_path):
    (f,) = _lint(tmp_path, USE_GH + "  b:\n    rules:\n"
                 "      - {name: r, hosts: [pypi.org], methods: [GET]}\n")
    assert f.field == "identities.b" and "no fixture" in f.message


def test_skipped_policy_looking_files(tmp_path):
    (tmp_path / "extra.yaml.new").write_text("version: v1\n")
    (tmp_path / "README.md").write_text("notes\n")
    (f,) = _lint(tmp_path, USE_GH)
    assert f.file.endswith("extra.yaml.new") and "skipped" in f.message


def test_a_subfolder_of_policy_files_is_skipped_unless_it_says_it_is_separate(tmp_path):
    (tmp_path / "team").mkdir()
    (tmp_path / "team" / "t.yaml").write_text("version: v1\n")
    (f,) = _lint(tmp_path, USE_GH)
    assert f.file.endswith("team") and f.code == "skipped-file"
    (tmp_path / "team" / ".separate-policy").write_text("")  # a reason is required
    assert len(_lint(tmp_path, USE_GH)) == 1
    (tmp_path / "team" / ".separate-policy").write_text("templates, checked on their own\n")
    assert _lint(tmp_path, USE_GH) == []
