"""Property-based fuzzing of the canonicalisers: hosts (and the address classifier behind them)
and paths (and the globs matched against them)."""

from __future__ import annotations

import ipaddress
import re
from functools import cache

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sandgate.decision import decide
from sandgate.netguard import classify, parse_ip_literal
from sandgate.policy.hosts import compile_host_pattern, normalise_host
from sandgate.policy.model import Identity, Policy, Rule, Source
from sandgate.policy.paths import compile_path_pattern, normalise_path
from sandgate.request import RequestInfo
from tests.unit.fuzz import examples

# ------------------------------------------------------------------------------------- hosts

NON_PUBLIC_V4 = [ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
    "0.0.0.0/8", "100.64.0.0/10",
)]

v4_non_public = st.sampled_from(NON_PUBLIC_V4).flatmap(
    lambda n: st.integers(int(n.network_address), int(n.broadcast_address)))


def _num(value: int, style: str, upper: bool, zeros: int) -> str:
    if style == "hex":
        text = "0x" + "0" * zeros + format(value, "x")
        return text.upper() if upper else text
    if style == "oct":
        return "0" + "0" * zeros + format(value, "o")
    return str(value)


@st.composite
def v4_spelling(draw: st.DrawFn, addr: int) -> str:
    """Any spelling a C resolver reads as `addr`: 1 to 4 parts, each decimal, octal or hex."""
    n = draw(st.integers(1, 4))
    b = addr.to_bytes(4, "big")
    values = {4: list(b), 3: [b[0], b[1], int.from_bytes(b[2:], "big")],
              2: [b[0], int.from_bytes(b[1:], "big")], 1: [addr]}[n]
    parts = [_num(v, draw(st.sampled_from(["dec", "hex", "oct"])), draw(st.booleans()),
                  draw(st.integers(0, 2))) for v in values]
    text = ".".join(parts)
    return text + ("." if draw(st.booleans()) else "")


@st.composite
def v6_embedding(draw: st.DrawFn, addr: int) -> str:
    """IPv6 spellings that carry the IPv4 address: mapped, translated, compatible, NAT64, 6to4."""
    dotted = str(ipaddress.IPv4Address(addr))
    hi, lo = format(addr >> 16, "x"), format(addr & 0xFFFF, "x")
    text = draw(st.sampled_from([
        f"::ffff:{dotted}", f"::ffff:{hi}:{lo}", f"0:0:0:0:0:ffff:{hi}:{lo}",
        f"::ffff:0:{dotted}", f"::ffff:0:{hi}:{lo}", f"0:0:0:0:ffff:0:{dotted}",
        f"::{dotted}", f"64:ff9b::{dotted}", f"64:ff9b::{hi}:{lo}", f"2002:{hi}:{lo}::1",
        f"64:ff9b:1::{hi}:{lo}",
    ]))
    if draw(st.booleans()):
        text = text.upper()
    return f"[{text}]" if draw(st.booleans()) else text


@given(v4_non_public.flatmap(lambda a: st.tuples(st.just(a), v4_spelling(a))))
def test_every_ipv4_spelling_of_a_non_public_address_is_non_public(case: tuple[int, str]) -> None:
    addr, spelling = case
    ip = parse_ip_literal(spelling)
    assert ip == ipaddress.IPv4Address(addr), spelling
    assert classify(ip) is not None
    canonical = normalise_host(spelling)
    assert canonical == str(ipaddress.IPv4Address(addr))
    canonical_ip = parse_ip_literal(canonical)
    assert canonical_ip is not None and classify(canonical_ip) is not None


@given(v4_non_public.flatmap(v6_embedding))
def test_every_ipv6_embedding_of_a_non_public_address_is_non_public(spelling: str) -> None:
    ip = parse_ip_literal(spelling)
    assert ip is not None and ip.version == 6, spelling
    assert classify(ip) is not None, spelling
    canonical = normalise_host(spelling)
    assert parse_ip_literal(canonical) == ip
    assert classify(ip) == classify(ipaddress.IPv6Address(canonical))


@given(st.sampled_from(["::1", "fe80::1", "fc00::1", "fd12:3456::1", "fec0::1", "ff02::1", "::",
                        "2001:db8::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2"]),
       st.booleans(), st.booleans(), st.sampled_from(["", "%eth0", "%25eth0", "%1"]))
def test_non_public_ipv6_in_any_spelling(addr: str, upper: bool, brackets: bool,
                                         zone: str) -> None:
    text = (addr.upper() if upper else addr) + zone
    spelling = f"[{text}]" if brackets else text
    ip = parse_ip_literal(spelling)
    assert ip == ipaddress.IPv6Address(addr)
    assert classify(ip) is not None
    assert normalise_host(spelling) == str(ip)


HOST_CHARS = "aZz09.-_:[]%x\u3002\uff0e\uff61\u00fc\u00df\u0131 @/\\\t\x00\x7f"
host_texts = st.one_of(
    st.text(alphabet=HOST_CHARS, max_size=20),
    st.text(max_size=20),
    st.integers(0, 2**32 - 1).flatmap(v4_spelling),
    st.integers(2**32, 2**40).map(lambda n: hex(n) if n % 2 else str(n)),
    st.integers(0, 2**32 - 1).flatmap(v6_embedding),
    st.builds(lambda a, b, dot, up: (f"{a}.{b}" + ("." if dot else "")).upper() if up
              else f"{a}.{b}" + ("." if dot else ""),
              st.sampled_from(["api", "xn--bcher-kva", "b\u00fccher", "a_b", "0x1f", "12", "*"]),
              st.sampled_from(["example.com", "com", "co.uk", "1", "0x7f", "internal"]),
              st.booleans(), st.booleans()),
)


@settings(max_examples=examples(300))
@given(host_texts)
def test_normalise_host_is_idempotent_and_consistent(raw: str) -> None:
    try:
        once = normalise_host(raw)
    except ValueError:
        return
    assert normalise_host(once) == once
    assert once == once.lower() and not once.endswith(".")
    ip = parse_ip_literal(once)
    if ip is not None:
        assert str(ip) == once
        assert parse_ip_literal(raw.strip().lower()) == ip
    else:
        # A name: plain LDH(+_) labels, and its last label is never numeric (a resolver would
        # read it as an address that nobody checked).
        assert re.fullmatch(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*", once), once
        last = once.rsplit(".", 1)[-1]
        assert not re.fullmatch(r"[0-9]+|0x[0-9a-f]*", last)


def _rule(name: str, action: str, hosts: tuple[str, ...], paths: tuple[str, ...] | None = None,
          schemes: frozenset[str] = frozenset({"https"}), ports: frozenset[int] = frozenset({443}),
          methods: frozenset[str] | None = None) -> Rule:
    return Rule(
        name=name, identity="id", action=action,  # type: ignore[arg-type]
        schemes=schemes, hosts=tuple(compile_host_pattern(h) for h in hosts), ports=ports,
        methods=methods,
        paths=None if paths is None else tuple(compile_path_pattern(p) for p in paths),
        inject=None, substitute=frozenset(), substitute_headers=frozenset(), private_cidrs=(),
        passthrough=False, source=Source("fuzz.yaml", 1),
    )


HOST_PATTERNS = ["api.example.com", "*.example.com", "127.0.0.1", "::1", "xn--bcher-kva.de",
                 "a_b.internal", "10.0.0.1", "*.co.uk"]


@given(host_texts, st.lists(st.sampled_from(HOST_PATTERNS), min_size=1, max_size=3),
       st.sampled_from(["allow", "deny"]))
def test_decide_on_a_raw_host_equals_decide_on_its_canonical_spelling(
        raw: str, patterns: list[str], action: str) -> None:
    try:
        canonical = normalise_host(raw)
    except ValueError:
        return
    policy = Policy(identities={"id": Identity("id", (_rule("r", action, tuple(patterns)),),
                                               Source("fuzz.yaml", 1))}, secrets={})
    a = decide(policy, "id", RequestInfo("https", raw, 443, "GET", "/"))
    b = decide(policy, "id", RequestInfo("https", canonical, 443, "GET", "/"))
    assert (a.allowed, a.code, a.rule_name) == (b.allowed, b.code, b.rule_name)
    matched = any(compile_host_pattern(p).matches(canonical) for p in patterns)
    assert a.rule_name == ("r" if matched else None)


@given(host_texts)
def test_raw_and_canonical_spellings_match_the_same_patterns(raw: str) -> None:
    try:
        canonical = normalise_host(raw)
    except ValueError:
        return
    for text in HOST_PATTERNS:
        p = compile_host_pattern(text)
        assert p.matches(canonical) == p.matches(normalise_host(canonical))


# ------------------------------------------------------------------------------------- paths

SEGMENTS = ["a", "b", "v1", "admin", "", ".", "..", "%2e", "%2E%2e", ".%2e", "%2f", "%2F..",
            "%5c", "\\", "%25", "%252e%252e", "caf%C3%A9", "caf\u00e9", "%20", "a b", "x;y=1",
            "*", "~u", "%3F", "%23", "%zz", "%c3", "%00", "\x01"]
raw_paths = st.one_of(
    st.builds(lambda segs, tail: "/" + "/".join(segs) + tail,
              st.lists(st.sampled_from(SEGMENTS), max_size=8),
              st.sampled_from(["", "/", "?q=/../admin", "#frag", "?", "//"])),
    st.text(max_size=30),
    st.text(max_size=30).map(lambda t: "/" + t),
)


def _check_shape(p: str) -> None:
    assert p.startswith("/")
    assert "//" not in p and "\\" not in p
    segs = p.split("/")[1:]
    assert "." not in segs and ".." not in segs  # never above the root, nothing to resolve
    assert not re.search(r"[\x00-\x1f\x7f]", p)


@settings(max_examples=examples(300))
@given(raw_paths)
def test_normalise_path_shape_and_idempotence(raw: str) -> None:
    try:
        once = normalise_path(raw)
    except ValueError:
        return
    _check_shape(once)
    if not any(c in once for c in "%?#"):
        # The canonical form is decoded exactly once: a '%', '?' or '#' in it is data that a
        # second pass would read as an escape, a query or a fragment (see test_policy_paths).
        assert normalise_path(once) == once


# Decoded paths without the characters percent-decoding or URL parsing give meaning to.
plain_paths = st.lists(
    st.one_of(st.sampled_from(["a", "v1", ".", "..", "", "caf\u00e9", "a b", "*", "x;y"]),
              st.text(max_size=6).filter(lambda t: not any(c in t for c in "%?#/\\"))),
    max_size=6,
).map(lambda segs: "/" + "/".join(segs))


@given(plain_paths, st.data())
def test_percent_encoded_variants_normalise_like_the_decoded_path(path: str,
                                                                  data: st.DataObject) -> None:
    try:
        want = normalise_path(path)
    except ValueError:
        assume(False)
        return
    out = ["/"]  # the leading slash is what makes it a path; every other character may be encoded
    for ch in path[1:]:
        if data.draw(st.booleans()):
            enc = "".join(f"%{b:02x}" for b in ch.encode("utf-8"))
            out.append(enc.upper() if data.draw(st.booleans()) else enc)
        else:
            out.append(ch)
    encoded = "".join(out)
    assert normalise_path(encoded) == want, encoded


# A reference glob matcher, written independently of match_segments: plain recursion.
def ref_match(pattern: str, path: str) -> bool:
    pat = tuple(pattern.split("/")[1:])
    segs = tuple(path.split("/")[1:])

    def seg_ok(p: str, s: str) -> bool:
        if p == "*":
            return s != ""
        rx = ".*".join(re.escape(x) for x in p.split("*"))
        return re.fullmatch(rx, s, re.DOTALL) is not None

    @cache
    def go(i: int, j: int) -> bool:
        if i == len(pat):
            return j == len(segs)
        if pat[i] == "**":
            return go(i + 1, j) or (j < len(segs) and go(i, j + 1))
        return j < len(segs) and seg_ok(pat[i], segs[j]) and go(i + 1, j + 1)

    return go(0, 0)


PATTERN_SEGS = ["a", "b", "v1", "**", "*", "a*", "*b", "*.json", "caf\u00e9", "a b", "x;y"]
patterns = st.builds(lambda segs, slash: "/" + "/".join(segs) + ("/" if slash and segs else ""),
                     st.lists(st.sampled_from(PATTERN_SEGS), max_size=5), st.booleans())
match_paths = st.one_of(
    raw_paths,
    st.lists(st.sampled_from(["a", "b", "v1", "ab", "x.json", "", "caf\u00e9", "a b", "x;y",
                              "%2e%2e", "%2f"]), max_size=6).map(lambda s: "/" + "/".join(s)),
)


@settings(max_examples=examples(300))
@given(patterns, match_paths)
def test_glob_matching_agrees_with_a_reference_and_is_stable(pattern: str, raw: str) -> None:
    try:
        compiled = compile_path_pattern(pattern)
    except ValueError:
        assume(False)
        return
    try:
        once = normalise_path(raw)
    except ValueError:
        return
    got = compiled.matches(once)
    assert got == ref_match(compiled.text, once), (pattern, once)
    if not any(c in once for c in "%?#"):
        assert compiled.matches(normalise_path(once)) == got
