"""`sandgate capture`: install, show or remove the transparent-capture nftables table.

    sandgate capture --interface IF --transparent [HOST:]PORT [--dns HOST:PORT]
                     [--allow HOST:PORT] [--capture-port N] [--capture-policies DIR]
        on the host the sandboxes' packets come in through (a veth, a bridge)
    sandgate capture --pod --transparent HOST:PORT [...]
        inside the sandbox's own network namespace (the Kubernetes init container)
    sandgate capture --interface IF --status | --remove

`sandgate sandbox network --transparent PORT` does the same for the Docker sandbox network.
No Docker needed here: the init container runs the sandgate image, without the docker extra.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from pathlib import Path
from typing import Any

from sandgate.capture import nftables as capture
from sandgate.capture.nftables import CaptureError


def host_port(spec: str, host_optional: bool = False) -> tuple[str | None, int]:
    """HOST:PORT (IPv6 in brackets), or PORT alone where the host may be left out."""
    host, sep, port = spec.rpartition(":")
    if not sep:
        host, port = "", spec
    if not host and not host_optional:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected HOST:PORT, e.g. 10.0.0.5:8443")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: the port must be a number") from None
    return (host.strip("[]") or None), number


def _required_host(spec: str) -> tuple[str, int]:
    host, port = host_port(spec)
    assert host is not None
    return host, port


def add_arguments(p: argparse.ArgumentParser, status: bool = True, dns: bool = True) -> None:
    """The capture options shared by `sandgate capture`, `sandbox network` and `sandbox run`
    (those have their own `--dns ADDRESS`, the policy DNS at port 53)."""
    if dns:
        p.add_argument("--dns", type=_required_host, default=None, metavar="HOST:PORT",
                       help="Sandgate's DNS (`sandgate run --dns`): the only resolver "
                       "sandboxes reach, at HOST port 53; every other DNS packet is dropped "
                       "and counted")
    p.add_argument("--capture-port", type=int, action="append", default=[], metavar="PORT",
                   help="capture this TCP port too (80 and 443 always are; repeatable)")
    p.add_argument("--capture-policies", type=Path, default=None, metavar="DIR",
                   help="capture every port an allow rule of these policies names")
    if status:
        p.add_argument("--status", action="store_true",
                       help="print the capture counters (captured, dropped by kind) and exit")


def register(sub: Any) -> None:
    p = sub.add_parser("capture", help="transparent capture: install the nftables rules that "
                       "send sandboxes' traffic to Sandgate or nowhere")
    p.set_defaults(handler=run)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--interface", metavar="IF",
                       help="the interface sandboxes' packets come in on (this host routes "
                       "them: a veth, a bridge)")
    where.add_argument("--pod", action="store_true",
                       help="inside the sandbox's own network namespace (init container)")
    p.add_argument("--transparent", type=lambda s: host_port(s, True), default=None,
                   metavar="[HOST:]PORT",
                   help="Sandgate's transparent listener (--interface: PORT alone redirects "
                   "to the address the packet came in to; a HOST name is resolved once, now)")
    p.add_argument("--allow", type=_required_host, action="append", default=[],
                   metavar="HOST:PORT", help="let TCP to this address through unchanged "
                   "(Sandgate's proxy listener, for proxy mode beside capture; repeatable)")
    p.add_argument("--remove", action="store_true", help="remove the table and exit")
    add_arguments(p)


def for_network(args: argparse.Namespace) -> capture.Capture | None:
    """`sandbox network/run --transparent PORT`: the capture for the Docker network's bridge
    (its interface and proxy port are filled in by sandgate.sandbox.network)."""
    if args.transparent is None:
        return None
    dns = (args.dns, capture.DNS_PORT) if args.dns else None
    return capture.Capture(listener=(None, args.transparent), ports=ports(args), dns=dns,
                           interface="-")  # "-": the bridge, filled in by install_capture


def ports(args: argparse.Namespace) -> tuple[int, ...]:
    extra = list(args.capture_port)
    if args.capture_policies is not None:
        from sandgate.policy import live

        extra += capture.rule_ports(live.load(args.capture_policies).policy)
    return capture.capture_ports(extra)


def address(host: str | None) -> str | None:
    """An address for the rules: a name (a Kubernetes Service) is resolved once, now, before
    the rules cut the namespace off from every resolver but Sandgate's."""
    if host is None:
        return None
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        raise CaptureError(f"cannot resolve {host!r}: {e}") from None
    return str(infos[0][4][0])


def _resolved(spec: tuple[str | None, int]) -> tuple[str | None, int]:
    return address(spec[0]), spec[1]


def _resolved_host(spec: tuple[str, int]) -> tuple[str, int]:
    host = address(spec[0])
    assert host is not None
    return host, spec[1]


def run(args: argparse.Namespace) -> int:
    tag = "pod" if args.pod else args.interface
    try:
        if args.status:
            sys.stdout.write(capture.format_counters(capture.counters(tag)))
            return 0
        if args.remove:
            capture.remove(tag)
            return 0
        if args.transparent is None:
            raise CaptureError("--transparent [HOST:]PORT is required")
        cap = capture.Capture(listener=_resolved(args.transparent), ports=ports(args),
                              dns=_resolved_host(args.dns) if args.dns else None,
                              allow=tuple(_resolved_host(a) for a in args.allow),
                              placement="pod" if args.pod else "router",
                              interface=args.interface)
        changed = capture.apply(tag, cap)
    except CaptureError as e:
        print(f"sandgate: {e}", file=sys.stderr)
        return 2
    print(f"sandgate: capture {'installed' if changed else 'already in place'}: table inet "
          f"{capture.table_name(tag)} (tcp {','.join(map(str, cap.ports))} -> "
          f"{cap.listener[0] or '<this address>'}:{cap.listener[1]}; everything else dropped)")
    return 0
