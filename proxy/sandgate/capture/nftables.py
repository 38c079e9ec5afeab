"""The nftables rules of transparent capture: what a sandbox sends goes to Sandgate or nowhere.

A sandbox's outbound TCP to the captured ports (80, 443 and the ports the policy's rules name)
is redirected to Sandgate's transparent listener (`sandgate run --transparent`), which judges it
as the CONNECT its TLS SNI or Host header stands for. DNS to Sandgate's DNS address (`sandgate
run --dns`) is let through (redirected to its port). Everything else the sandbox sends (other
TCP ports, UDP, QUIC on 443/udp, DNS to any other resolver, ICMP) is dropped and counted: never
forwarded unjudged. Proxy mode keeps working beside it: the proxy listener's ports at Sandgate's
address are accepted as they are.

One table per sandbox network (`inet sandgate_capture_<tag>`), in one of two places:

- `router`: on the host the sandboxes' packets come in through (the Docker bridge, a veth):
  prerouting, keyed on the input interface. The redirect keeps the original destination in
  this host's conntrack, where Sandgate reads it (SO_ORIGINAL_DST) and checks it against the
  name it judges.
- `pod`: inside the sandbox's own network namespace (the Kubernetes init container, the
  compose firewall service): output, every packet the sandbox's processes send. The
  connection is DNATed to Sandgate's address, so Sandgate sees only the name (SNI, Host).

The table is replaced in one `nft -f` transaction (no moment without the final drop) and left
alone, counters and all, when it already holds these rules (its comment is their digest).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sandgate.errors import SetupFailed
from sandgate.policy.model import Policy

WEB_PORTS = (80, 443)
DNS_PORT = 53
# what is dropped, each with its own counter: `sandgate sandbox network --status` prints them
COUNTERS = ("captured", "dns_allowed", "dropped_quic", "dropped_dns", "dropped_tcp",
            "dropped_udp", "dropped_other")
_TAG = re.compile(r"[^A-Za-z0-9_]")


class CaptureError(SetupFailed):
    """The capture table cannot be built or installed. The message says what to do."""


@dataclass(frozen=True)
class Capture:
    """Where a sandbox network's traffic goes.

    listener: Sandgate's transparent listener (HOST, PORT). In `router` placement HOST may be
      None: redirect to PORT at the address the packet came in to (the gateway).
    ports: TCP ports captured (80 and 443 are always).
    dns: Sandgate's DNS (HOST, PORT): the one resolver sandboxes may reach, at HOST port 53
      (redirected to PORT). None: every DNS packet is dropped.
    allow: TCP (HOST, PORT) reached unchanged (the proxy listener, role listeners: proxy mode).
    """

    listener: tuple[str | None, int]
    ports: tuple[int, ...] = WEB_PORTS
    dns: tuple[str, int] | None = None
    allow: tuple[tuple[str, int], ...] = ()
    placement: str = "router"  # or "pod"
    interface: str | None = None  # router: the interface sandboxes' packets come in on

    def __post_init__(self) -> None:
        if self.placement not in ("router", "pod"):
            raise CaptureError(f"capture placement {self.placement!r}: router or pod")
        if self.placement == "router" and not self.interface:
            raise CaptureError("capture on a router needs the sandboxes' interface")
        if self.placement == "pod" and self.listener[0] is None:
            raise CaptureError("capture in a pod needs Sandgate's address (HOST:PORT)")
        for host, port in (self.listener, *self.allow, *([self.dns] if self.dns else [])):
            _check_port(port)
            if host is not None:
                _ip(host)
        for port in self.ports:
            _check_port(port)
        if self.placement == "pod" and not set(self.ports) <= set(WEB_PORTS):
            raise CaptureError("a pod's table captures only ports 80 and 443: Sandgate cannot "
                               "learn the original port of a connection DNATed in another "
                               "namespace, so it judges TLS as port 443 and plain HTTP as 80")


def _check_port(port: int) -> None:
    if not 0 < int(port) < 65536:
        raise CaptureError(f"port {port} is out of range")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise CaptureError(f"{host!r} is not an IP address (the capture rules need "
                           "addresses, not names)") from None


def table_name(tag: str) -> str:
    return f"sandgate_capture_{_TAG.sub('_', tag)}"[:64]


def capture_ports(extra: Iterable[int] = ()) -> tuple[int, ...]:
    return tuple(sorted({*WEB_PORTS, *(int(p) for p in extra)}))


def _fam(host: str) -> str:
    return "ip6" if _ip(host).version == 6 else "ip"


def _set(ports: Iterable[int]) -> str:
    return "{ " + ", ".join(str(p) for p in sorted(set(ports))) + " }"


def _addr(host: str, port: int) -> str:
    ip = _ip(host)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def ruleset(tag: str, cap: Capture) -> str:
    """The table, as `nft -f` reads it (replacing an older one in the same transaction)."""
    name = table_name(tag)
    body = _body(cap)
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    # the ports this host must accept from the sandboxes (the host firewall reads them back)
    opened = f"tcp:{cap.listener[1]}" + (f" udp:{cap.dns[1]}" if cap.dns else "")
    return (f"table inet {name} {{}}\ndelete table inet {name}\n"
            f"table inet {name} {{\n\tcomment \"sandgate capture {digest} {opened}\"\n"
            f"{body}}}\n")


def digest_of(text: str) -> str | None:
    m = re.search(r'comment "sandgate capture ([0-9a-f]{16})', text)
    return m.group(1) if m else None


def listener_ports(tag: str, netns: str | None = None) -> tuple[list[int], list[int]]:
    """The (TCP, UDP) ports an installed table sends to this host (the transparent listener,
    the DNS): the host firewall keeps them open. Nothing installed: ([], [])."""
    if shutil.which("nft") is None:
        return [], []
    res = _run(["list", "table", "inet", table_name(tag)], netns=netns)
    m = re.search(r'comment "sandgate capture [0-9a-f]{16} tcp:(\d+)(?: udp:(\d+))?"',
                  res.stdout) if res.returncode == 0 else None
    if m is None:
        return [], []
    dns = [int(m.group(2))] if m.group(2) else []
    return [int(m.group(1)), *dns], dns


def _body(cap: Capture) -> str:
    lines: list[str] = [f"\tcounter {c} {{}}" for c in COUNTERS]
    ports = _set(cap.ports)
    host, tport = cap.listener
    if cap.placement == "router":
        match = f'iifname "{cap.interface}" '
        hook, nat_hook = "prerouting priority mangle", "prerouting priority dstnat"
    else:
        match = 'oifname != "lo" '
        hook, nat_hook = "output priority filter", "output priority -100"
    if host is None:
        to_listener = f"redirect to :{tport}"
    else:
        to_listener = f"dnat {_fam(host)} to {_addr(host, tport)}"
    nat: list[str] = []
    keep: list[str] = []  # accepted unchanged by the filter chain
    for ahost, aport in cap.allow:  # proxy mode: Sandgate's proxy listener, as it is
        nat.append(f"{_fam(ahost)} daddr {_ip(ahost)} tcp dport {aport} return")
        keep.append(f"{_fam(ahost)} daddr {_ip(ahost)} tcp dport {aport} accept")
    if cap.dns is not None:
        dhost, dport = cap.dns
        fam, ip = _fam(dhost), _ip(dhost)
        for proto in ("udp", "tcp"):
            if dport != DNS_PORT:
                nat.append(f"{fam} daddr {ip} {proto} dport {DNS_PORT} "
                           f"dnat {fam} to {_addr(dhost, dport)}")
            keep.append(f"{fam} daddr {ip} {proto} dport {_set([DNS_PORT, dport])} "
                        "counter name dns_allowed accept")
    if host is None or _ip(host).version == 4:
        cond = "" if host is None else "meta nfproto ipv4 "
        nat.append(f"{cond}tcp dport {ports} counter name captured {to_listener}")
    else:
        nat.append(f"meta nfproto ipv6 tcp dport {ports} counter name captured {to_listener}")
    if cap.placement == "router":
        # before the redirect (mangle < dstnat): the original destination decides
        filt = ["ct state established,related accept",  # what was accepted, and its replies
                *keep,
                f"tcp dport {ports} accept"]  # redirected to the listener (nat chain)
    else:
        # after the DNAT (filter > dstnat): only Sandgate's addresses are left to accept
        lhost = host
        assert lhost is not None
        filt = ["ct state established,related accept", *keep,
                f"{_fam(lhost)} daddr {_ip(lhost)} tcp dport {tport} accept"]
    filt += [
        # IPv6 needs neighbour discovery with the next hop
        "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit } accept",
        "udp dport 443 counter name dropped_quic drop",  # QUIC: clients fall back to TCP
        f"meta l4proto {{ tcp, udp }} th dport {DNS_PORT} counter name dropped_dns drop",
        "meta l4proto tcp counter name dropped_tcp drop",
        "meta l4proto udp counter name dropped_udp drop",
        "counter name dropped_other drop",
    ]
    if cap.placement == "pod":
        filt = ['oifname "lo" accept', *filt]
    out = "\n".join(lines) + "\n"
    out += f"\tchain filter {{\n\t\ttype filter hook {hook}; policy accept;\n"
    if cap.placement == "router":
        out += f"\t\t{match.strip()} jump sandbox\n\t}}\n\tchain sandbox {{\n"
        out += "".join(f"\t\t{r}\n" for r in filt) + "\t}\n"
    else:
        out += "".join(f"\t\t{r}\n" for r in filt) + "\t}\n"
    out += f"\tchain nat {{\n\t\ttype nat hook {nat_hook}; policy accept;\n"
    out += "".join(f"\t\t{match}{r}\n" for r in nat) + "\t}\n"
    return out


# --- applying and reading -----------------------------------------------------------------------


def nft() -> str:
    exe = shutil.which("nft")
    if exe is None:
        raise CaptureError("nft (nftables) is not installed: transparent capture needs it")
    return exe


def _run(args: Sequence[str], script: str | None = None,
         netns: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [nft(), *args]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=30)


def apply(tag: str, cap: Capture, netns: str | None = None) -> bool:
    """Install (or replace) the table; returns False when it already held these rules."""
    script = ruleset(tag, cap)
    current = _run(["list", "table", "inet", table_name(tag)], netns=netns)
    if current.returncode == 0 and digest_of(current.stdout) == digest_of(script):
        return False
    res = _run(["-f", "-"], script, netns)
    if res.returncode != 0:
        raise CaptureError(f"nft: {res.stderr.strip()}")
    return True


def remove(tag: str, netns: str | None = None) -> None:
    _run(["delete", "table", "inet", table_name(tag)], netns=netns)


def counters(tag: str, netns: str | None = None) -> dict[str, dict[str, int]] | None:
    """Packets and bytes per counter, or None when the table is not installed."""
    res = _run(["-j", "list", "counters", "table", "inet", table_name(tag)], netns=netns)
    if res.returncode != 0:
        return None
    out: dict[str, dict[str, int]] = {}
    for item in json.loads(res.stdout).get("nftables", []):
        c = item.get("counter")
        if c is not None:
            out[str(c["name"])] = {"packets": int(c["packets"]), "bytes": int(c["bytes"])}
    return out


def format_counters(found: dict[str, dict[str, int]] | None) -> str:
    if found is None:
        return "transparent capture: not installed\n"
    return "".join(f"{name}\t{found.get(name, {}).get('packets', 0)} packets\t"
                   f"{found.get(name, {}).get('bytes', 0)} bytes\n" for name in COUNTERS)


def rule_ports(policy: Policy) -> tuple[int, ...]:
    """The captured ports for a policy: 80, 443 and every port an allow rule names."""
    return capture_ports(port for ident in policy.identities.values() for rule in ident.rules
                         if rule.action == "allow" for port in rule.ports)
