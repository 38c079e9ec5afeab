"""StaticCidrSource: static address ranges -> identities, most specific prefix wins."""

from __future__ import annotations

import pytest

from sandgate.identity.base import AddressIdentitySource, Caller
from sandgate.identity.cidr import StaticCidrSource, parse_cidr_entries, parse_cidr_map


def test_is_an_address_identity_source() -> None:
    source: AddressIdentitySource = StaticCidrSource([("10.0.0.0/8", "a", None)])
    assert source.lookup("10.1.2.3") == Caller("a", None, "cidr")


def test_most_specific_prefix_wins_regardless_of_order() -> None:
    src = StaticCidrSource([
        ("10.20.5.0/24", "bash-tool", "sbx-5"),
        ("10.0.0.0/8", "wide", None),
        ("10.20.0.0/16", "bash-tool", None),
        ("10.20.5.7/32", "one-host", "h7"),
    ])
    assert src.lookup("10.20.5.7") == Caller("one-host", "h7", "cidr")
    assert src.lookup("10.20.5.8") == Caller("bash-tool", "sbx-5", "cidr")
    assert src.lookup("10.20.9.1") == Caller("bash-tool", None, "cidr")
    assert src.lookup("10.99.0.1") == Caller("wide", None, "cidr")
    assert src.lookup("11.0.0.1") is None


def test_range_edges() -> None:
    src = StaticCidrSource([("192.168.4.0/22", "lab", None)])
    assert src.lookup("192.168.4.0") is not None
    assert src.lookup("192.168.7.255") is not None
    assert src.lookup("192.168.3.255") is None
    assert src.lookup("192.168.8.0") is None


def test_ipv6_and_ipv4_mapped() -> None:
    src = StaticCidrSource([
        ("fd00:5a9d::/32", "v6", None),
        ("fd00:5a9d:1::/48", "v6-narrow", "n"),
        ("10.0.0.0/8", "v4", None),
    ])
    assert src.lookup("fd00:5a9d:1::5") == Caller("v6-narrow", "n", "cidr")
    assert src.lookup("fd00:5a9d:2::5") == Caller("v6", None, "cidr")
    assert src.lookup("::ffff:10.1.1.1") == Caller("v4", None, "cidr")  # dual-stack listener
    assert src.lookup("fe80::1%eth0") is None
    # the IPv4 table never answers for an IPv6 address with the same integer value
    assert src.lookup("::a00:1") is None


def test_default_route_prefix() -> None:
    src = StaticCidrSource([("0.0.0.0/0", "everyone", None), ("10.0.0.0/8", "ten", None)])
    assert src.lookup("8.8.8.8") == Caller("everyone", None, "cidr")
    assert src.lookup("10.0.0.1") == Caller("ten", None, "cidr")
    assert src.lookup("::1") is None


@pytest.mark.parametrize("garbage", ["", "not-an-ip", "10.0.0", "10.0.0.1/8", "999.1.1.1", "::g"])
def test_garbage_address_is_unknown(garbage: str) -> None:
    assert StaticCidrSource([("0.0.0.0/0", "x", None)]).lookup(garbage) is None


def test_empty_source_knows_nothing() -> None:
    assert StaticCidrSource([]).lookup("10.0.0.1") is None


def test_parse_lines() -> None:
    text = """
    # sandboxes
    10.20.0.0/16=bash-tool
    10.20.5.0/24 = bash-tool/sbx-5   # a narrower one
    172.30.99.7=agent
    fd00::/8=v6
    """
    assert parse_cidr_entries(text) == [
        ("10.20.0.0/16", "bash-tool", None),
        ("10.20.5.0/24", "bash-tool", "sbx-5"),
        ("172.30.99.7/32", "agent", None),
        ("fd00::/8", "v6", None),
    ]
    src = parse_cidr_map(text)
    assert isinstance(src, StaticCidrSource)
    assert src.lookup("10.20.5.1") == Caller("bash-tool", "sbx-5", "cidr")


def test_parse_accepts_a_list_of_cli_values() -> None:
    src = parse_cidr_map(["10.0.0.0/8=a", "10.1.0.0/16=b/s1"])
    assert src.lookup("10.1.0.1") == Caller("b", "s1", "cidr")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("10.20.0.0/16", "expected CIDR=IDENTITY"),
        ("=bash-tool", "expected CIDR=IDENTITY"),
        ("10.20.0.0/16=", "expected CIDR=IDENTITY"),
        ("10.20.0.0/33=x", "is not an IP network"),
        ("banana=x", "is not an IP network"),
        ("10.20.0.1/16=x", "host bits set; did you mean 10.20.0.0/16"),
        ("10.20.0.0/16=bad name", "invalid identity"),
        ("10.20.0.0/16=x/", "invalid sandbox"),
        ("10.20.0.0/16=x/a/b", "invalid sandbox"),
    ],
)
def test_parse_errors_are_clear(line: str, message: str) -> None:
    with pytest.raises(ValueError, match="line 2") as err:
        parse_cidr_map(["10.0.0.0/8=ok", line])
    assert message in str(err.value)


def test_same_range_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"10\.0\.0\.0/8 is mapped twice"):
        parse_cidr_map(["10.0.0.0/8=a", "10.0.0.0/8=b"])


def test_constructor_validates_too() -> None:
    with pytest.raises(ValueError, match="host bits"):
        StaticCidrSource([("10.0.0.1/8", "a", None)])
    with pytest.raises(ValueError, match="invalid identity"):
        StaticCidrSource([("10.0.0.0/8", "", None)])
