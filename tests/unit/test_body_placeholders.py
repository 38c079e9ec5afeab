"""Body placeholders (sandgate.secrets.body): parsed, swapped only inside string values, and an
unresolved placeholder refused."""

from __future__ import annotations

import json
from urllib.parse import parse_qsl, urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mitmproxy.test import tutils

from sandgate.errors import Code
from sandgate.inject import apply
from sandgate.policy.loader import load_policy_files
from sandgate.secrets.body import MAX_BODY, Unresolved, plan, render

pytestmark = pytest.mark.unit

PH = "sandgate-placeholder-openai"
PH_ADMIN = "sandgate-placeholder-openai-admin"  # contains PH
VALUE = "test-openai-VALUE-q\"uo\\te&=+%"  # characters both encodings must escape
ADMIN = "test-openai-ADMIN-value"
PHS = {PH: "openai", PH_ADMIN: "admin"}
VALUES = {"openai": VALUE, "admin": ADMIN}
JSON = "application/json"
FORM = "application/x-www-form-urlencoded"


def swap(body: bytes, ctype: str | None, encoded: bool = False) -> bytes:
    p = plan(body, ctype, encoded, PHS)
    return body if p is None else render(body, p, VALUES, PHS)


def refused(body: bytes, ctype: str | None, encoded: bool = False) -> Unresolved:
    with pytest.raises(Unresolved) as ei:
        plan(body, ctype, encoded, PHS)
    assert VALUE not in str(ei.value)
    return ei.value


def test_json_whole_and_partial_values_swapped_rest_byte_for_byte():
    body = (b'{ "model" : "m",\n "api_key": "' + PH.encode() + b'", "auth": {"h": "Bearer '
            + PH.encode() + b'"}, "list": ["' + PH_ADMIN.encode() + b'", 1.000000000000000001]}')
    out = swap(body, "application/json; charset=utf-8")
    doc = json.loads(out)
    assert doc["api_key"] == VALUE and doc["auth"]["h"] == "Bearer " + VALUE
    assert doc["list"][0] == ADMIN  # the longer placeholder, not PH inside it
    # everything outside the swapped strings is as sent (numbers, spacing, order)
    assert out.startswith(b'{ "model" : "m",\n "api_key": "')
    assert out.endswith(b'", 1.000000000000000001]}')


def test_json_escaped_placeholder_is_found_by_its_decoded_text():
    escaped = json.dumps(PH, ensure_ascii=False).replace("s", "\\u0073", 1).encode()
    out = swap(b'{"k": ' + escaped + b"}", JSON)
    assert json.loads(out) == {"k": VALUE}


def test_vendor_json_type_is_json():
    assert json.loads(swap(b'{"k": "' + PH.encode() + b'"}', "application/vnd.api+json")) == {
        "k": VALUE}


def test_form_value_swapped_and_encoded_again():
    body = urlencode({"a": "1", "api_key": PH, "note": "x " + PH_ADMIN}).encode()
    out = swap(body, FORM)
    assert dict(parse_qsl(out.decode(), strict_parsing=True)) == {
        "a": "1", "api_key": VALUE, "note": "x " + ADMIN}
    assert out.startswith(b"a=1&api_key=")


def test_percent_encoded_placeholder_in_a_form_value_is_swapped():
    body = b"k=" + PH.replace("-", "%2D").encode()
    assert dict(parse_qsl(swap(body, FORM).decode())) == {"k": VALUE}


@pytest.mark.parametrize(("body", "ctype", "what"), [
    (b'{"' + PH.encode() + b'": 1}', JSON, "outside a string value"),  # a key
    (b'{"a": {"' + PH.encode() + b'" : "x"}}', JSON, "outside a string value"),
    (b'{"k": "' + PH.encode() + b'", "k": "y"}', JSON, "does not parse"),  # a key twice
    (b'{"k": "' + PH.encode() + b'"', JSON, "does not parse"),  # truncated
    (PH.encode() + b"=1", FORM, "outside a string value"),  # a field name
    (PH.replace("-", "%2D").encode() + b"=1", FORM, "outside a string value"),
    (b"key " + PH.encode(), "text/plain", "neither JSON nor a form"),
    (b"key " + PH.encode(), None, "neither JSON nor a form"),
    (b"k=" + PH.replace("-", "%2D").encode(), "text/plain", "neither JSON nor a form"),
])
def test_unresolved_placeholder_refused(body, ctype, what):
    e = refused(body, ctype)
    assert e.code == Code.EXFILTRATION and what in e.reason
    assert e.names


def test_compressed_body_with_placeholder_refused():
    e = refused(b'{"k": "' + PH.encode() + b'"}', JSON, encoded=True)
    assert "compressed" in e.reason


def test_over_the_bound_with_placeholder_refused_without_parsing():
    body = b'{"k": "' + PH.encode() + b'", "pad": "' + b"x" * MAX_BODY + b'"}'
    assert refused(body, JSON).code == Code.TOO_LARGE
    assert plan(b'{"pad": "' + b"x" * MAX_BODY + b'"}', JSON, False, PHS) is None


def test_no_placeholder_no_plan():
    assert plan(b'{"k": "v"}', JSON, False, PHS) is None
    assert plan(b"not json at all", JSON, False, PHS) is None  # nothing to swap: upstream's call
    assert plan(b"a=1", FORM, False, PHS) is None


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | _text | st.sampled_from([PH, "x" + PH + "y"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_text, kids, max_size=4),
    max_leaves=12)


def _expect(doc: object) -> object:
    if isinstance(doc, str):
        return doc.replace(PH, VALUE)
    if isinstance(doc, list):
        return [_expect(d) for d in doc]
    if isinstance(doc, dict):
        return {k: _expect(v) for k, v in doc.items()}
    return doc


@given(_json, st.booleans())
def test_json_swap_is_the_parsed_swap(doc, ascii_only):
    """Swapping in the bytes equals swapping in the parsed document: whatever the nesting,
    escapes and keys, only string values change, and a key holding a placeholder refuses."""
    body = json.dumps(doc, ensure_ascii=ascii_only).encode()
    keys_hold = PH in json.dumps(_keys(doc))
    if keys_hold:
        with pytest.raises(Unresolved):
            plan(body, JSON, False, {PH: "openai"})
        return
    p = plan(body, JSON, False, {PH: "openai"})
    out = body if p is None else render(body, p, {"openai": VALUE}, {PH: "openai"})
    assert json.loads(out) == _expect(doc)


def _keys(doc: object) -> list[str]:
    if isinstance(doc, list):
        return [k for d in doc for k in _keys(d)]
    if isinstance(doc, dict):
        return [*doc, *(k for v in doc.values() for k in _keys(v))]
    return []


@given(st.lists(st.tuples(_text.filter(lambda t: PH not in t),
                          _text | st.sampled_from([PH, PH + " " + PH])), max_size=5))
def test_form_swap_is_the_parsed_swap(pairs):
    body = urlencode(pairs).encode()
    p = plan(body, FORM, False, {PH: "openai"})
    out = body if p is None else render(body, p, {"openai": VALUE}, {PH: "openai"})
    assert parse_qsl(out.decode(), keep_blank_values=True) == [
        (k, v.replace(PH, VALUE)) for k, v in pairs]


POLICY = f"""
version: v1
secrets:
  openai: {{vault: secret/data/llm/openai, field: api_key, placeholder: {PH}}}
identities:
  a:
    rules:
      - name: body
        hosts: [api.example.com]
        substitute: [openai]
        substitute_body: true
"""


def test_apply_swaps_body_and_sets_length(tmp_path):
    (tmp_path / "p.yaml").write_text(POLICY)
    pol = load_policy_files([tmp_path / "p.yaml"])
    rule = pol.identities["a"].rules[0]
    assert rule.substitute_body
    body = b'{"api_key": "' + PH.encode() + b'"}'
    req = tutils.treq(content=body, headers=((b"content-type", b"application/json"),
                                             (b"content-length", str(len(body)).encode())))
    p = plan(body, JSON, False, {PH: "openai"})
    apply(rule, req, {"openai": VALUE}, {"openai": PH}, p)
    assert json.loads(req.content or b"") == {"api_key": VALUE}
    assert req.headers["content-length"] == str(len(req.raw_content or b""))


def test_explain_names_the_body(tmp_path):
    from sandgate.explain.answer import explain_request

    (tmp_path / "p.yaml").write_text(POLICY)
    out, allowed = explain_request(load_policy_files([tmp_path / "p.yaml"]), "a", "POST",
                                   "https://api.example.com/v1/x")
    assert allowed
    assert out["inject"] == ["body (JSON string values, form field values): placeholder of "
                             "secret(s) openai; refused if one cannot be swapped"]
