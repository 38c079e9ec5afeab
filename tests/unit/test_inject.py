"""Injection, placeholder substitution and leak detection on real mitmproxy requests."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from mitmproxy.test import tutils

from sandgate.errors import UnsafeValue
from sandgate.inject import apply, find_leaks, own_forms
from sandgate.policy.loader import load_policy_dir
from sandgate.scrub.scrubber import SecretSet

POLICY = """
version: v1
secrets:
  gh: {vault: secret/data/gh, field: token}
  openai: {vault: secret/data/oa, field: key}
  openai-admin: {vault: secret/data/oa-admin, field: key}
identities:
  a:
    rules:
      - name: hdr
        hosts: [h.example]
        inject: {headers: {Authorization: "Bearer {{ secrets.gh }}"}}
      - name: basicq
        hosts: [b.example]
        inject:
          basic: {username: x, password: "{{secrets.gh}}"}
          query: {token: "{{ secrets.gh }}"}
      - name: sub
        hosts: [s.example]
        substitute: [openai-admin]
      - name: sub-custom
        hosts: [c.example]
        substitute: [openai-admin]
        substitute_headers: [X-Custom-Key]
"""


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    d: Path = tmp_path_factory.mktemp("p")
    (d / "p.yaml").write_text(POLICY)
    return load_policy_dir(d)


def rule(policy, name):
    return next(r for r in policy.identities["a"].rules if r.name == name)


def test_header_injection_replaces_any_case(policy):
    req = tutils.treq(headers=[(b"AUTHORIZATION", b"mine"), (b"authorization", b"dup")])
    apply(rule(policy, "hdr"), req, {"gh": "v-123"}, {"gh": "sandgate-placeholder-gh"})
    assert req.headers.get_all("authorization") == ["Bearer v-123"]


def test_basic_and_query(policy):
    req = tutils.treq(path=b"/x?token=mine&y=1")
    apply(rule(policy, "basicq"), req, {"gh": "v-9"}, {"gh": "sandgate-placeholder-gh"})
    assert base64.b64decode(req.headers["authorization"][6:]) == b"x:v-9"
    assert req.query["token"] == "v-9" and req.query["y"] == "1"


@pytest.mark.parametrize("bad", ["a\r\nX-Evil: 1", "a\nb", "a\0b"])
def test_control_characters_never_reach_a_header(policy, bad):
    req = tutils.treq()
    with pytest.raises(UnsafeValue) as e:
        apply(rule(policy, "hdr"), req, {"gh": bad}, {"gh": "sandgate-placeholder-gh"})
    assert bad not in str(e.value)


def test_substitution_of_bound_placeholder(policy):
    req = tutils.treq(headers=[(b"authorization", b"Bearer sandgate-placeholder-openai-admin")])
    apply(rule(policy, "sub"), req, {"openai-admin": "real-admin"},
          {"openai-admin": "sandgate-placeholder-openai-admin"})
    assert req.headers["authorization"] == "Bearer real-admin"


@pytest.mark.parametrize("where,kw", [
    ("header", {"headers": [(b"x-key", b"sandgate-placeholder-gh")]}),
    ("url", {"path": b"/a?k=sandgate-placeholder-gh"}),
    ("url", {"path": b"/a?k=sandgate%2Dplaceholder%2Dgh"}),
    ("body", {"content": b'{"k": "sandgate-placeholder-gh"}'}),
])
def test_unbound_placeholder_found(policy, where, kw):
    req = tutils.treq(**kw)
    leaks = find_leaks(req, req.raw_content or b"", policy.placeholders, SecretSet({}),
                       frozenset())
    assert {(lk.secret, lk.kind, lk.where) for lk in leaks} == {("gh", "placeholder", where)}


def test_bound_placeholder_containing_another_is_not_a_leak(policy):
    req = tutils.treq(headers=[(b"authorization", b"Bearer sandgate-placeholder-openai-admin")])
    bound = frozenset({"openai-admin"})
    assert find_leaks(req, b"", policy.placeholders, SecretSet({}), bound) == []


def test_real_value_anywhere_is_a_leak(policy):
    req = tutils.treq(content=b"token=cached-value-1")
    secrets = SecretSet({"gh": "cached-value-1"})
    leaks = find_leaks(req, req.raw_content or b"", policy.placeholders, secrets, frozenset({"gh"}))
    assert [(lk.secret, lk.kind) for lk in leaks] == [("gh", "value")]


def test_placeholder_is_substituted_only_in_the_named_headers(policy):
    ph = b"sandgate-placeholder-openai-admin"
    req = tutils.treq(headers=[(b"authorization", b"Bearer " + ph), (b"x-echo", ph),
                               (b"x-api-key", ph)])
    apply(rule(policy, "sub"), req, {"openai-admin": "real-admin"},
          {"openai-admin": ph.decode()})
    assert req.headers["authorization"] == "Bearer real-admin"
    assert req.headers["x-api-key"] == "real-admin"
    assert req.headers["x-echo"] == ph.decode()  # a reflecting upstream never sees the value

    req = tutils.treq(headers=[(b"authorization", ph), (b"x-custom-key", ph)])
    apply(rule(policy, "sub-custom"), req, {"openai-admin": "real-admin"},
          {"openai-admin": ph.decode()})
    assert req.headers["x-custom-key"] == "real-admin"
    assert req.headers["authorization"] == ph.decode()


def test_non_latin1_value_is_substituted_as_utf8(policy):
    ph = b"sandgate-placeholder-openai-admin"
    req = tutils.treq(headers=[(b"authorization", b"Bearer " + ph)])
    apply(rule(policy, "sub"), req, {"openai-admin": "FAKE-\u00e9\u4e2d"},
          {"openai-admin": ph.decode()})
    assert req.headers.fields[0][1] == "Bearer FAKE-\u00e9\u4e2d".encode()


def test_own_forms_are_what_injection_sends(policy):
    values = {"gh": "FAKE-gh-token-1"}
    forms = own_forms(policy, values)
    req = tutils.treq(path=b"/x")
    apply(rule(policy, "basicq"), req, values, {"gh": "sandgate-placeholder-gh"})
    sent_basic = req.headers["authorization"][len("Basic "):].encode()
    assert sent_basic in forms["gh"]
    assert any(f in req.path.encode() for f in forms["gh"])
