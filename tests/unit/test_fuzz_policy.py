"""Property-based fuzzing of the policy loader: any file either loads or fails with located
problems (PolicyError), never with any other exception."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from sandgate.policy.loader import PolicyError, load_policy_files
from sandgate.policy.model import Policy
from tests.unit.fuzz import examples

REAL_KEYS = [
    "version", "secrets", "identities", "tests", "rules", "name", "action", "hosts", "schemes",
    "ports", "methods", "paths", "inject", "headers", "basic", "username", "password", "query",
    "substitute", "substitute_headers", "private_cidrs", "passthrough", "description", "vault",
    "mount", "path", "field", "kv_version", "placeholder", "identity", "request", "expect",
    "rule", "<<",
]
REAL_VALUES = [
    "v1", "v2", "allow", "deny", "https", "http", "ftp", "GET", "post", "BAD METHOD", "/v1/**",
    "/v1/*/x", "/a//b", "/../x", "/%2e", "v1/no-slash", "*.example.com", "*", "*.com",
    "api.example.com", "EXAMPLE.com.", "127.0.0.1", "0x7f000001", "[::1]", "a.*.b",
    "https://x.example.com", "x.example.com:443", "bücher.de", "{{ secrets.k }}",
    "Bearer {{ secrets.k }}", "{{ secrets.nope }}", "{{ other }}", "x\r\ny", "secret/data/a/b",
    "secret/a", "/data/", "k", "sandgate-placeholder-k", "short", "10.0.0.0/8", "0.0.0.0/0",
    "fd00::/64", "not-a-cidr", "GET https://api.example.com/v1/x", "GET", "GET http://[::1",
    "PUT https://u:p@example.com/", "authorization", "host", "x-api-key", "Bad Header", "",
    " ", "\x00", "\ufeff",
]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(REAL_VALUES),
    st.text(max_size=12),
)
keys = st.one_of(st.sampled_from(REAL_KEYS), st.text(max_size=8), st.integers(-3, 3),
                 st.booleans(), st.none())


def loose(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.lists(children, max_size=4),
                     st.dictionaries(keys, children, max_size=4))


junk = st.recursive(scalars, loose, max_leaves=12)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the well-shaped value, sometimes junk in its place."""
    return st.one_of(strategy, strategy, strategy, junk)


def str_list(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return maybe(st.lists(values, max_size=3))


def opt_dict(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[Any]:
    return maybe(st.fixed_dictionaries(required, optional=optional))


names = st.one_of(st.sampled_from(["a", "b", "k", "api", "bad name", "-x", "ä"]),
                  st.text(max_size=6))
values = st.sampled_from(REAL_VALUES)
templates = st.one_of(values, st.text(max_size=10))

rule = opt_dict(
    {"name": maybe(names)},
    {
        "action": maybe(st.sampled_from(["allow", "deny"])),
        "hosts": str_list(values),
        "schemes": str_list(st.sampled_from(["https", "http", "ftp"])),
        "ports": str_list(st.integers(-1, 70000)),
        "methods": str_list(values),
        "paths": str_list(values),
        "inject": opt_dict({}, {
            "headers": maybe(st.dictionaries(values, templates, max_size=3)),
            "basic": opt_dict({"username": templates, "password": templates}, {}),
            "query": maybe(st.dictionaries(values, templates, max_size=2)),
        }),
        "substitute": str_list(names),
        "substitute_headers": str_list(values),
        "private_cidrs": str_list(values),
        "passthrough": maybe(st.booleans()),
        "bogus": junk,
    },
)
secret = opt_dict({"field": maybe(values)}, {
    "vault": maybe(values), "mount": maybe(values), "path": maybe(values),
    "kv_version": maybe(st.sampled_from([1, 2, 3])), "placeholder": maybe(values),
})
identity = maybe(st.one_of(st.none(), st.fixed_dictionaries(
    {}, optional={"rules": maybe(st.lists(rule, max_size=4)), "description": maybe(values)})))
fixture = opt_dict({"identity": maybe(names), "request": maybe(values),
                    "expect": maybe(st.sampled_from(["allow", "deny"]))},
                   {"rule": maybe(names)})
policy_doc = st.fixed_dictionaries(
    {"version": st.one_of(st.just("v1"), st.just("v1"), scalars)},
    optional={
        "secrets": maybe(st.dictionaries(names, secret, max_size=3)),
        "identities": maybe(st.dictionaries(names, identity, max_size=3)),
        "tests": maybe(st.lists(fixture, max_size=3)),
        "extra": junk,
    },
)

# YAML text built from fragments: anchors, aliases, tags, merge keys, flow and block styles.
FRAGMENTS = [
    "version: v1", "secrets:", "identities:", "tests:", "  a:", "    rules:", "    - name: r",
    "      hosts: [a.example.com]", "      hosts: *h", "      <<: *m", "  &m {name: x}",
    "&h [x.example.com]", "- !!binary aGVsbG8=", "x: !!set {a, b}", "x: !!python/object:os.sep",
    "x: !!timestamp 2001-12-14", "? [a, b]", ": c", "{", "}", "[", "]", "'", '"', "%YAML 1.1",
    "---", "...", "x: |", "  text", "\t- tab", "x: *undefined", "&a x: 1", "- &r [*r]",
    "    paths: ['/v1/**']", "    inject: {headers: {x-api-key: {{ secrets.k }}}}",
    "version: v1\nversion: v1", "\ufeffversion: v1", "x: 1e400", "x: 0x7f", "x: .nan",
]
yaml_text = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=15)), max_size=12
).map("\n".join)


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


def _check(content: str | bytes) -> Policy | None:
    text = content if isinstance(content, str) else content.decode("utf-8", "replace")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "policy.yaml"
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8", errors="surrogatepass")
        else:
            path.write_bytes(content)
        try:
            policy = load_policy_files([path])
        except PolicyError as e:
            assert e.problems, "a PolicyError names at least one problem"
            for p in e.problems:
                assert p.file == str(path)
                assert isinstance(p.line, int) and p.line >= 0
                assert isinstance(p.message, str) and p.message.strip()
                assert isinstance(p.fix, str) and p.fix.strip()
                # A line past the end of the file would point nowhere.
                assert p.line <= len(text.splitlines()) + 1
            return None
        assert isinstance(policy, Policy)
        assert policy.files == (str(path),)
        return policy


@settings(max_examples=examples(150))
@given(policy_doc)
def test_structured_documents_load_or_fail_with_located_problems(doc: dict[str, Any]) -> None:
    _check(_dump(doc))


@given(junk)
def test_any_yaml_value_loads_or_fails_with_located_problems(doc: Any) -> None:
    _check(_dump(doc))


@given(yaml_text)
def test_yaml_fragments_load_or_fail_with_located_problems(text: str) -> None:
    _check(text)


@given(st.text(max_size=200))
def test_random_text(text: str) -> None:
    _check(text)


@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    _check(data)


def test_deeply_nested_yaml_is_a_policy_error() -> None:
    """Regression: deeply nested flow collections used to escape as RecursionError."""
    text = "version: v1\nx: " + "{a: " * 1200 + "1" + "}" * 1200
    assert _check(text) is None


def test_a_valid_generated_policy_loads() -> None:
    """The structured generator can produce loadable policies (so the properties above reach
    the compiler, not only the schema)."""
    doc = {
        "version": "v1",
        "secrets": {"k": {"vault": "secret/data/a/b", "field": "k"}},
        "identities": {"a": {"rules": [{
            "name": "r", "hosts": ["api.example.com"], "paths": ["/v1/**"],
            "inject": {"headers": {"x-api-key": "{{ secrets.k }}"}},
        }]}},
        "tests": [{"identity": "a", "request": "GET https://api.example.com/v1/x",
                   "expect": "allow"}],
    }
    policy = _check(_dump(doc))
    assert policy is not None
    assert [r.name for r in policy.identities["a"].rules] == ["r"]
    assert len(policy.tests) == 1


def test_control_character_is_a_located_policy_error() -> None:
    """Regression: a character YAML refuses (e.g. U+001F) used to escape as yaml ReaderError,
    raised before the loader's error handling."""
    for text, line in (("\x1f", 1), ("version: v1\nsecrets:\n  a\x07: {}\n", 3)):
        try:
            load_policy_files([_write(text)])
        except PolicyError as e:
            assert [(p.line, "does not allow" in p.message) for p in e.problems] == [(line, True)]
        else:
            raise AssertionError("loaded a file with a control character")


def _write(text: str) -> Path:
    d = Path(tempfile.mkdtemp())
    path = d / "p.yaml"
    path.write_text(text, encoding="utf-8")
    return path
