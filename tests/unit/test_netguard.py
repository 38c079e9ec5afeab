"""Every spelling of an inside address is recognised and refused unless a rule names it."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandgate.errors import AddressRefused
from sandgate.netguard import choose_address, classify, ip_text, is_this_host, parse_ip_literal


@pytest.mark.parametrize("spelling,canonical", [
    ("127.0.0.1", "127.0.0.1"), ("127.1", "127.0.0.1"), ("0x7f000001", "127.0.0.1"),
    ("2130706433", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"), ("0x7f.0.0.1", "127.0.0.1"),
    ("127.0.0.1.", "127.0.0.1"), ("[::1]", "::1"), ("::1", "::1"),
    ("[::ffff:127.0.0.1]", "::ffff:127.0.0.1"), ("[fe80::1%eth0]", "fe80::1"),
    ("0", "0.0.0.0"), ("10.1", "10.0.0.1"),
])
def test_numeric_spellings_parse(spelling, canonical):
    ip = parse_ip_literal(spelling)
    assert ip is not None and ip_text(ip) == canonical


@given(st.integers(0, 2**32 - 1))
def test_ipv4_mapped_text_is_the_same_on_every_python(n):
    # RFC 5952 section 5: ::ffff:a.b.c.d (Python 3.13's str(); 3.12 writes ::ffff:7f00:1)
    v4 = ipaddress.IPv4Address(n)
    mapped = ipaddress.IPv6Address((0xFFFF << 32) | n)
    assert ip_text(mapped) == f"::ffff:{v4}"
    assert parse_ip_literal(ip_text(mapped)) == mapped


@given(st.integers(0, 2**128 - 1))
def test_ip_text_round_trips_every_ipv6_address(n):
    ip = ipaddress.IPv6Address(n)
    assert ipaddress.IPv6Address(ip_text(ip)) == ip
    if ip.ipv4_mapped is None:
        assert ip_text(ip) == str(ip)


@pytest.mark.parametrize("name", ["example.com", "1.example", "0x7g.1", "api.anthropic.com",
                                  "1.2.3.4.5", "", "[not-v6]"])
def test_names_are_not_addresses(name):
    assert parse_ip_literal(name) is None


@pytest.mark.parametrize("addr,kind", [
    ("127.0.0.1", "loopback"), ("10.0.0.1", "private"), ("172.16.5.4", "private"),
    ("192.168.1.1", "private"), ("169.254.169.254", "link_local"), ("100.64.0.1", "cgnat"),
    ("100.100.100.200", "cgnat"), ("0.0.0.0", "this_network"), ("224.0.0.1", "multicast"),
    ("255.255.255.255", "reserved"), ("240.0.0.1", "reserved"), ("198.18.0.1", "benchmarking"),
    ("192.0.2.1", "documentation"), ("::1", "loopback"), ("::", "unspecified"),
    ("fe80::1", "link_local"), ("fd00::1", "ula"), ("fc00::1", "ula"), ("ff02::1", "multicast"),
    ("::ffff:10.0.0.1", "ipv4_mapped:private"), ("::ffff:8.8.8.8", "ipv4_mapped:public"),
    ("::ffff:0:7f00:1", "ipv4_translated:loopback"),
    ("::ffff:0:a9fe:a9fe", "ipv4_translated:link_local"), ("0:0:0:ffff:0:0:7f00:1", "reserved"),
    ("::7f00:1", "ipv4_compatible"), ("64:ff9b::7f00:1", "nat64"), ("64:ff9b:1::1", "nat64"),
    ("2002:7f00:1::", "6to4"), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "teredo"),
    ("fec0::1", "site_local"), ("2001:db8::1", "reserved"),
])
def test_classify_inside(addr, kind):
    assert classify(ipaddress.ip_address(addr)) == kind


@pytest.mark.parametrize("addr", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "151.101.0.223"])
def test_classify_public(addr):
    assert classify(ipaddress.ip_address(addr)) is None


def ips(*a: str):
    return [ipaddress.ip_address(x) for x in a]


def test_choose_refuses_inside_unless_named():
    with pytest.raises(AddressRefused) as e:
        choose_address("db.internal", 443, ips("10.20.1.5"), ())
    assert e.value.code == "internal_address"
    assert "10.20.1.5 is private" in str(e.value)
    t = choose_address("db.internal", 443, ips("10.20.1.5"), [ipaddress.ip_network("10.20.0.0/16")])
    assert str(t.ip) == "10.20.1.5"


def test_mapped_address_matches_v4_range_and_is_dialled_as_v4():
    t = choose_address("x", 443, ips("::ffff:10.20.1.5"), [ipaddress.ip_network("10.20.0.0/16")])
    assert t.ip == ipaddress.ip_address("10.20.1.5")


def test_mixed_answer_skips_inside_and_dials_public():
    t = choose_address("x", 443, ips("127.0.0.1", "93.184.216.34"), ())
    assert str(t.ip) == "93.184.216.34"


def test_no_answer_is_unresolvable():
    with pytest.raises(AddressRefused) as e:
        choose_address("nx.example", 443, [], ())
    assert e.value.code == "unresolvable"


def test_never_dials_itself_even_when_range_is_named():
    selves = [(ipaddress.ip_address("0.0.0.0"), 8080)]
    with pytest.raises(AddressRefused) as e:
        choose_address("x", 8080, ips("127.0.0.1"), [ipaddress.ip_network("127.0.0.0/8")], selves)
    assert e.value.code == "self_address"
    # same address, other port: not itself
    t = choose_address("x", 443, ips("127.0.0.1"), [ipaddress.ip_network("127.0.0.0/8")], selves)
    assert t.port == 443


# ---------------------------------------------------------------- the unspecified address

_ZERO_NET = st.integers(0, 2**24 - 1).map(lambda n: ipaddress.IPv4Address(n))


def _spellings(v4: ipaddress.IPv4Address) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    n = int(v4)
    return [v4, ipaddress.IPv6Address(0xFFFF00000000 | n),  # ::ffff:a.b.c.d
            ipaddress.IPv6Address(0xFFFF0000_00000000 | n),  # ::ffff:0:a.b.c.d (SIIT)
            ipaddress.IPv6Address(int(ipaddress.IPv6Address("64:ff9b::")) | n)]  # NAT64


@given(_ZERO_NET)
def test_every_spelling_of_this_network_is_this_host(v4):
    for ip in _spellings(v4):
        assert is_this_host(ip), ip
        with pytest.raises(AddressRefused) as e:
            # whatever private_cidrs say, and with no listener of Sandgate on that port
            choose_address("zero.test", 9, [ip], [ipaddress.ip_network("0.0.0.0/0"),
                                                  ipaddress.ip_network("::/0")])
        assert e.value.code == "self_address"


@pytest.mark.parametrize("literal", ["0", "0.0.0.0", "0x0", "00.0.0.0", "0.1.2.3", "[::]",
                                     "::0.0.0.0", "[::ffff:0.0.0.0]", "::ffff:0:0.0.0.0"])
def test_unspecified_literals_are_this_host(literal):
    ip = parse_ip_literal(literal)
    assert ip is not None and is_this_host(ip)


@pytest.mark.parametrize("addr", ["1.0.0.0", "127.0.0.1", "::1", "10.0.0.1", "8.8.8.8",
                                  "::ffff:1.0.0.0", "2001:db8::"])
def test_other_addresses_are_not_this_host(addr):
    assert not is_this_host(ipaddress.ip_address(addr))
