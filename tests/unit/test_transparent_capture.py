"""Transparent capture, the parts that need no network: the nftables table it writes, the
listener option, where a captured connection's original destination can be trusted, and the
Kubernetes example's init container (tests/integration/test_transparent.py runs it for real)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sandgate.addons.pinned import pinned
from sandgate.capture import nftables as capture
from sandgate.capture.nftables import Capture, CaptureError
from sandgate.cli import build_parser
from sandgate.cli.capture import host_port
from sandgate.cli.run import cmd_run
from sandgate.policy.loader import load_policy_dir
from sandgate.runner.config import RunConfig, check_listeners
from sandgate.stages.s15_capture import redirected_here, same_ip

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
POD = REPO / "deploy/kubernetes/examples/sandbox-pod-transparent.yaml"


def router() -> Capture:
    return Capture(listener=(None, 8443), ports=(80, 443, 8443), dns=("172.30.99.1", 5353),
                   allow=(("172.30.99.1", 8080),), interface="br-x")


def lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines()]


def test_router_table_redirects_the_captured_ports_and_drops_and_counts_the_rest() -> None:
    text = capture.ruleset("br-x", router())
    got = lines(text)
    assert 'iifname "br-x" tcp dport { 80, 443, 8443 } counter name captured redirect to :8443' \
        in got
    # the proxy listener stays reachable as it is (proxy mode beside capture)
    assert 'iifname "br-x" ip daddr 172.30.99.1 tcp dport 8080 return' in got
    # Sandgate's DNS (port 53 on the wire) goes to its port; every other resolver is dropped
    assert 'iifname "br-x" ip daddr 172.30.99.1 udp dport 53 dnat ip to 172.30.99.1:5353' in got
    filt = got[got.index("chain sandbox {"):]
    order = ["udp dport 443 counter name dropped_quic drop",
             "meta l4proto { tcp, udp } th dport 53 counter name dropped_dns drop",
             "meta l4proto tcp counter name dropped_tcp drop",
             "meta l4proto udp counter name dropped_udp drop",
             "counter name dropped_other drop"]
    assert [filt.index(r) for r in order] == sorted(filt.index(r) for r in order)
    # the DNS accept comes before the DNS drop, the captured accept before the TCP drop
    assert filt.index("ip daddr 172.30.99.1 udp dport { 53, 5353 } counter name dns_allowed "
                      "accept") < filt.index(order[1])
    assert filt.index("tcp dport { 80, 443, 8443 } accept") < filt.index(order[2])
    # the filter runs before the redirect: the original destination decides
    assert "type filter hook prerouting priority mangle; policy accept;" in got
    assert "type nat hook prerouting priority dstnat; policy accept;" in got
    assert text.startswith("table inet sandgate_capture_br_x {}\ndelete table inet "
                           "sandgate_capture_br_x\n")  # replaced in one transaction


def test_pod_table_dnats_to_sandgate_and_accepts_only_its_addresses() -> None:
    cap = Capture(listener=("10.0.0.5", 8443), dns=("10.0.0.5", 53),
                  allow=(("10.0.0.5", 8080),), placement="pod")
    got = lines(capture.ruleset("pod", cap))
    assert ('oifname != "lo" meta nfproto ipv4 tcp dport { 80, 443 } counter name captured '
            "dnat ip to 10.0.0.5:8443") in got
    assert "type filter hook output priority filter; policy accept;" in got
    assert "ip daddr 10.0.0.5 tcp dport 8443 accept" in got
    assert not any("redirect" in ln for ln in got)


def test_no_dns_address_drops_every_dns_packet() -> None:
    got = lines(capture.ruleset("br-x", Capture(listener=(None, 8443), interface="br-x")))
    assert not any("dns_allowed accept" in ln for ln in got)
    assert "meta l4proto { tcp, udp } th dport 53 counter name dropped_dns drop" in got


def test_digest_names_the_rules_and_the_opened_ports() -> None:
    a = capture.ruleset("br-x", router())
    assert capture.digest_of(a) == capture.digest_of(capture.ruleset("br-x", router()))
    other = Capture(listener=(None, 9443), interface="br-x")
    assert capture.digest_of(a) != capture.digest_of(capture.ruleset("br-x", other))
    assert 'comment "sandgate capture ' in a and ' tcp:8443 udp:5353"' in a


@pytest.mark.parametrize("kwargs, message", [
    ({"listener": (None, 8443)}, "needs the sandboxes' interface"),
    ({"listener": (None, 8443), "placement": "pod"}, "needs Sandgate's address"),
    ({"listener": ("sandgate.example", 8443), "placement": "pod"}, "is not an IP address"),
    ({"listener": (None, 0), "interface": "x"}, "out of range"),
    ({"listener": (None, 8443), "interface": "x", "ports": (80, 70000)}, "out of range"),
    ({"listener": (None, 8443), "interface": "x", "placement": "host"}, "router or pod"),
])
def test_bad_capture_is_refused_clearly(kwargs: dict, message: str) -> None:
    with pytest.raises(CaptureError, match=message):
        Capture(**kwargs)


def test_rule_ports_are_80_443_and_every_port_an_allow_rule_names(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "version: v1\nidentities:\n  a:\n    rules:\n"
        "      - {name: r1, hosts: ['x.example'], ports: [8443], methods: [GET]}\n"
        "      - {name: r2, hosts: ['y.example'], methods: [GET]}\n")
    policy = load_policy_dir(tmp_path)
    assert capture.rule_ports(policy) == (80, 443, 8443)


@given(st.integers(1, 65535))
def test_host_port_reads_port_alone_and_host_port(port: int) -> None:
    assert host_port(str(port), True) == (None, port)
    assert host_port(f"10.0.0.5:{port}") == ("10.0.0.5", port)
    assert host_port(f"[fd00::5]:{port}") == ("fd00::5", port)


def test_host_port_refuses_what_it_cannot_read() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected HOST:PORT"):
        host_port("8443")
    with pytest.raises(argparse.ArgumentTypeError, match="must be a number"):
        host_port("10.0.0.5:https")


def test_transparent_listener_is_a_pinned_mode() -> None:
    assert pinned("32m", None, transparent=("10.0.0.1", 8443))["mode"] == [
        "regular", "transparent@10.0.0.1:8443"]
    assert pinned("32m", None)["mode"] == ["regular"]


def test_transparent_listener_needs_its_own_address(tmp_path: Path) -> None:
    cfg = RunConfig(policies=tmp_path, confdir=tmp_path, listen_host="0.0.0.0", listen_port=8080,
                    transparent=("10.0.0.1", 8080))
    with pytest.raises(ValueError, match=r"--transparent 10\.0\.0\.1:8080 is the address"):
        check_listeners(cfg)


def test_transparent_without_an_address_identity_source_is_refused(capsys) -> None:
    args = build_parser().parse_args(["run", "--policies", str(REPO / "policies"),
                                      "--transparent", "127.0.64.1:8443"])
    assert cmd_run(args) != 0
    assert "identifies callers by source address only" in capsys.readouterr().err


def mode(host: str | None, port: int | None) -> SimpleNamespace:
    return SimpleNamespace(proxy_mode=SimpleNamespace(custom_listen_host=host,
                                                      custom_listen_port=port))


def test_original_destination_is_trusted_only_when_redirected_on_this_host() -> None:
    # redirected here: SO_ORIGINAL_DST is where the sandbox connected to
    assert redirected_here(mode("10.64.0.1", 8443), ("198.51.100.64", 443))  # type: ignore
    # DNATed in another namespace (a pod): the connection is addressed to the listener itself
    assert not redirected_here(mode("10.64.0.1", 8443), ("10.64.0.1", 8443))  # type: ignore
    assert not redirected_here(mode("0.0.0.0", 8443), ("10.0.0.9", 8443))  # type: ignore
    assert not redirected_here(mode(None, 8443), ("::ffff:10.0.0.9", 8443))  # type: ignore


def test_same_ip_folds_mapped_addresses() -> None:
    assert same_ip("::ffff:198.51.100.64", "198.51.100.64")
    assert not same_ip("198.51.100.64", "198.51.100.65")
    assert not same_ip("not-an-ip", "198.51.100.64")


def test_kubernetes_init_container_alone_holds_net_admin() -> None:
    pod = yaml.safe_load(POD.read_text())
    init = pod["spec"]["initContainers"]
    assert [c["name"] for c in init] == ["capture"]
    caps = init[0]["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    for c in pod["spec"]["containers"]:
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert not any("proxy" in e["name"].lower() for e in c.get("env", []))
    # its command is one `sandgate capture` accepts
    argv = init[0]["command"][1:] + init[0]["args"]
    args = build_parser().parse_args(argv)
    assert args.pod and args.transparent == ("sandgate.sandgate.svc.cluster.local", 8443)
    assert args.dns == ("10.96.0.53", 53)
    assert pod["spec"]["dnsConfig"]["nameservers"] == ["10.96.0.53"]


def test_capture_cli_needs_no_docker() -> None:
    # the Kubernetes init container runs the sandgate image, which has no docker extra
    code = ("import sys; sys.modules['docker'] = None\n"
            "from sandgate.cli import build_parser\n"
            "a = build_parser().parse_args(['capture', '--pod', '--transparent', 'x:1'])\n"
            "print(a.handler.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "sandgate.cli.capture", r.stderr[-2000:]


def test_a_pod_table_captures_only_the_ports_whose_scheme_it_can_tell() -> None:
    with pytest.raises(CaptureError, match="only ports 80 and 443"):
        Capture(listener=("10.0.0.5", 8443), ports=(80, 443, 8443), placement="pod")
    assert Capture(listener=("10.0.0.5", 8443), ports=(443,), placement="pod").ports == (443,)


def test_port_judged_is_the_original_or_the_schemes() -> None:
    from sandgate.stages.flow import Captured
    from sandgate.stages.s15_capture import port_of

    assert port_of(Captured(("198.51.100.64", 8443)), tls=True) == 8443
    unknown = Captured(("10.0.0.5", 8443), known=False)
    assert (port_of(unknown, tls=True), port_of(unknown, tls=False)) == (443, 80)
