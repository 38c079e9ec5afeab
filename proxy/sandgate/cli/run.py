"""`sandgate run`: the proxy's flags, their checks, and the start of the main job."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandgate.audit import options as audit_setup
from sandgate.audit.export import startup as export_setup
from sandgate.cli.common import confdir_arg, load_error
from sandgate.cli.common import err as _err
from sandgate.identity.base import AddressIdentitySource

if TYPE_CHECKING:
    from sandgate.admin.access import AdminUser
    from sandgate.dns.run import DnsConfig
    from sandgate.limits import LimitsConfig
    from sandgate.state import StateConfig


def _listen(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not (0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 127.0.0.1:8080, got {spec!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _size(spec: str) -> str:
    from mitmproxy.utils import human

    try:
        if human.parse_size(spec) is None:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 512k, 32m or 1g, got {spec!r}") from None
    return spec


def _workers(spec: str) -> int:
    if not spec.isdigit() or int(spec) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes >= 1, got {spec!r}")
    return int(spec)


ADMIN_OPENABLE = ("/readyz", "/metrics")


def register(sub: Any) -> None:
    run = sub.add_parser("run", help="run the proxy")
    run.add_argument("--policies", type=Path, required=True, help="directory of policy YAML files")
    run.add_argument("--listen", type=_listen, default=("127.0.0.1", 8080), metavar="HOST:PORT")
    confdir_arg(run)
    run.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                     help="set a mitmproxy option, as mitmdump does")
    run.add_argument("--resolve", action="append", default=[], metavar="HOST=IP",
                     help="split-horizon DNS: dial IP for HOST (the port comes from the request)")
    run.add_argument("--upstream-ca", action="append", default=[], type=Path, metavar="FILE",
                     help="trust this CA for upstreams, in addition to the system roots")
    run.add_argument("--audit", type=Path, default=None, metavar="FILE",
                     help="append audit events here (default: stdout)")
    audit_setup.add_arguments(run)
    run.add_argument("--secret-ttl", type=float, default=300.0, metavar="SECONDS")
    run.add_argument("--max-request-body", type=_size, default="32m", metavar="SIZE",
                     help="refuse request bodies larger than this with 413 (default %(default)s; "
                     "bodies are buffered to be inspected before anything is sent)")
    lim = run.add_argument_group(
        "limits", "0 turns a count or timeout limit off; identities' `limits:` in the policy "
        "override the per-identity ones (docs/operations.md, Limits)")
    lim.add_argument("--max-header-bytes", type=_size, default="64k", metavar="SIZE",
                     help="refuse a request head (CONNECT or request) larger than this with 431 "
                     "(default %(default)s)")
    lim.add_argument("--max-headers", type=int, default=100, metavar="N",
                     help="refuse a request with more header fields with 431 (default "
                     "%(default)s)")
    lim.add_argument("--max-connections", type=int, default=4096, metavar="N",
                     help="client connections open at once; past it a new one is closed at "
                     "once (default %(default)s)")
    lim.add_argument("--max-connections-per-identity", type=int, default=256, metavar="N",
                     help="client connections one identity may hold open; past it 429 "
                     "too_many_connections (default %(default)s)")
    lim.add_argument("--rps", type=float, default=0.0, metavar="N",
                     help="requests per second per identity (token bucket); past it 429 "
                     "rate_limited with Retry-After (default: off)")
    lim.add_argument("--burst", type=int, default=0, metavar="N",
                     help="requests an identity may send at once before --rps applies "
                     "(default: --rps rounded up)")
    lim.add_argument("--header-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="a started HTTP/1 request head must end within this; else 408 and "
                     "the connection is closed (default %(default)s)")
    lim.add_argument("--first-byte-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="close an unidentified connection that sent nothing this long after "
                     "connecting (default %(default)s)")
    lim.add_argument("--handshake-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="close an unidentified connection whose TLS handshake with Sandgate "
                     "has not ended this long after connecting (default %(default)s)")
    lim.add_argument("--identify-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="close a connection not identified (CONNECT or request) this long "
                     "after connecting (default %(default)s)")
    lim.add_argument("--max-unidentified-per-source", type=int, default=128, metavar="N",
                     help="connections one source address may hold before they are "
                     "identified; past it a new one is closed at once (default %(default)s)")
    lim.add_argument("--idle-timeout", type=float, default=300.0, metavar="SECONDS",
                     help="close a connection on which nothing moved for this long (default "
                     "%(default)s; 0: mitmproxy's own 600)")
    lim.add_argument("--upstream-connect-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="504 upstream_timeout when the upstream's TCP connect takes longer "
                     "(default %(default)s)")
    lim.add_argument("--upstream-read-timeout", type=float, default=120.0, metavar="SECONDS",
                     help="504 upstream_timeout when the upstream sends nothing for this long "
                     "after the last byte either way: to the response head, between chunks "
                     "(default %(default)s)")
    lim.add_argument("--upstream-reuse-idle", type=float, default=2.0, metavar="SECONDS",
                     help="keep an idle upstream connection (HTTP/1.1 or HTTP/2) this long for "
                     "the next client connection of the same caller to the same checked "
                     "address and name (default %(default)s; 0: every client connection dials "
                     "its own)")
    st = run.add_argument_group(
        "shared state", "one state for every worker and replica (docs/fleet-state.md)")
    st.add_argument("--state", default=None, metavar="URL",
                    help="count rates, connections per identity and secret budgets for the "
                    "whole fleet, and end sandboxes everywhere, on this Redis: "
                    "redis://HOST[:PORT][/DB] or rediss:// (TLS); default: per process")
    st.add_argument("--state-prefix", default="sandgate:", metavar="PREFIX",
                    help="prefix of every key and channel (default %(default)s)")
    st.add_argument("--state-timeout", type=float, default=0.25, metavar="SECONDS",
                    help="the longest a request waits for the state (default %(default)s)")
    st.add_argument("--state-fail", choices=("open", "closed"), default="open",
                    help="while the state is down, rates and connections are counted per "
                    "process (open) or refused (closed); budgets are always refused "
                    "(default %(default)s)")
    st.add_argument("--state-password-file", type=Path, default=None, metavar="FILE",
                    help="the Redis AUTH password (instead of one in the URL)")
    st.add_argument("--state-ca", type=Path, default=None, metavar="FILE",
                    help="rediss://: trust this CA for the server's certificate")
    st.add_argument("--state-lease-kv", default=None, metavar="MOUNT/PREFIX",
                    help="one dynamic-secret lease per sandbox for the fleet, its value relayed "
                    "through this Vault KV v2 path (default: each process mints its own)")
    run.add_argument("--audit-best-effort", action="store_true",
                     help="keep forwarding while the audit log cannot be written (default: "
                     "refuse with 503 audit_unavailable until a write succeeds)")
    export_setup.add_arguments(run)
    run.add_argument("--canary", action="store_true",
                     help="refuse and audit any request carrying an identity's decoy credential "
                     "(see `sandgate canary`); scrub it from responses")
    run.add_argument("--identity-cidr", action="append", default=[],
                     metavar="CIDR=IDENTITY[/SANDBOX]",
                     help="identify clients from this range without a token (VMs, namespaces); "
                     "a client from elsewhere is identified by its proxy token")
    run.add_argument("--address-identity-only", action="store_true",
                     help="with --identity-cidr: refuse a client outside every range even with "
                     "a valid proxy token")
    run.add_argument("--docker-network", action="append", default=[], metavar="NAME",
                     help="identify clients on this Docker network by their container labels")
    run.add_argument("--socks5", type=_listen, default=None, metavar="HOST:PORT",
                     help="also listen for SOCKS5 here (username/password = identity/token, "
                     "names resolved by Sandgate); off unless given")
    run.add_argument("--socks5-allow", action="append", default=[], metavar="CIDR",
                     help="serve SOCKS5 only to sources in this range (repeatable; others are "
                     "dropped at connect and audited)")
    run.add_argument("--transparent", type=_listen, default=None, metavar="HOST:PORT",
                     help="also accept connections the sandbox network's nftables rules "
                     "redirect here (transparent capture: no proxy settings, identity by source "
                     "address; see `sandgate sandbox network --transparent`); off unless given")
    run.add_argument("--gateway", type=_listen, default=None, metavar="HOST:PORT",
                     help="serve the policy's `gateways:` here (base-URL gateway mode: plain "
                     "HTTP, for internal networks only, unless --gateway-tls-name)")
    run.add_argument("--gateway-tls-name", default=None, metavar="NAME",
                     help="the gateway takes TLS only, with a certificate for NAME from the "
                     "confdir CA (sandboxes trust `sandgate ca`)")
    run.add_argument("--dns", type=_listen, default=None, metavar="HOST:PORT",
                     help="serve the policy DNS here (UDP and TCP): the sandboxes' resolver, "
                     "answering only names a rule of the caller's identity could reach "
                     "(identity from the source address); docs/dns.md")
    run.add_argument("--dns-upstream", type=_listen, action="append", default=[],
                     metavar="HOST:PORT", help="the recursive resolver the policy DNS asks "
                     "for allowed names (repeatable; default: this host's resolv.conf)")
    run.add_argument("--dns-refuse", choices=("nxdomain", "refused"), default="nxdomain",
                     help="the answer to a name no rule reaches (default %(default)s)")
    run.add_argument("--dns-rps", type=float, default=50.0, metavar="N",
                     help="policy DNS queries a second per source address; past it REFUSED "
                     "(default %(default)s)")
    run.add_argument("--dns-burst", type=int, default=100, metavar="N",
                     help="policy DNS queries a source may send at once (default %(default)s)")
    run.add_argument("--dns-max-ttl", type=int, default=60, metavar="SECONDS",
                     help="the longest TTL the policy DNS answers (default %(default)s)")
    run.add_argument("--dns-max-answers", type=int, default=8, metavar="N",
                     help="records in one policy DNS answer at most (default %(default)s)")
    run.add_argument("--role-listen", action="append", default=[], metavar="ROLE=HOST:PORT",
                     help="pattern 1 split: the listener a split sandbox's tool (or other) "
                     "users are sent to (tool=HOST:PORT, other=HOST:PORT); docs/pattern1.md")
    run.add_argument("--tool-identity", action="append", default=[], metavar="AGENT=TOOL",
                     help="pattern 1 split: the identity of AGENT's bash tool (tool listener)")
    run.add_argument("--agent-dir", type=Path, default=None, metavar="DIR",
                     help="pattern 1 without a hook: the directory `sandgate agent run` "
                     "registers agent processes in; only root or Sandgate's user may write it "
                     "(docs/pattern1.md)")
    run.add_argument("--agent-split", action="append", default=[], metavar="AGENT=TOOL",
                     help="with --agent-dir: identity AGENT is given only to a registered "
                     "agent's own process; every other process in its network namespace is "
                     "identity TOOL, whatever token it sends")
    run.add_argument("--admin", type=_listen, default=None, metavar="HOST:PORT",
                     help="serve the admin API (health, readiness, metrics, policy, reload) "
                     "here; off unless given")
    run.add_argument("--admin-token-file", type=Path, default=None, metavar="FILE",
                     help="the admin API's bearer token (default: env SANDGATE_ADMIN_TOKEN)")
    run.add_argument("--admin-users", type=Path, default=None, metavar="FILE",
                     help="named admin API users with roles (viewer, approver, admin) and "
                     "the sha256 of each one's token (docs/approvals.md); the admin token "
                     "stays the user `admin`")
    run.add_argument("--admin-login-limit", type=_login_limit, default=5, metavar="N",
                     help="wrong admin tokens a minute from one address (the console's login, "
                     "the admin API's Bearer) before it is answered 429 for the rest of the "
                     "minute, right token or not; 20 N from all addresses together "
                     "(docs/console.md)")
    run.add_argument("--admin-open", action="append", default=[], choices=ADMIN_OPENABLE,
                     metavar="PATH",
                     help="serve this admin path without the bearer token, for probes and "
                     "scrapers that carry none: /readyz or /metrics (repeatable; /healthz "
                     "always is)")
    run.add_argument("--instance", default=None, metavar="NAME",
                     help="this replica's name, in every audit event and in sandgate_info "
                     "(default: env SANDGATE_INSTANCE, else the host name)")
    run.add_argument("--admin-max-token-ttl", default="24h", metavar="TTL",
                     help="longest proxy token POST /v1/tokens issues (default %(default)s)")
    run.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM, wait this long for in-flight requests and streams "
                     "(default %(default)s)")
    run.add_argument("--no-watch", action="store_true",
                     help="do not reload when a policy file changes (SIGHUP and "
                     "POST /v1/reload still do)")
    run.add_argument("--log-format", choices=("json", "text"), default=None,
                     help="process log format on stderr (default: json unless stderr is a "
                     "terminal)")
    run.add_argument("--workers", type=_workers, default=None, metavar="N",
                     help="proxy processes sharing the listening port (default: the number of "
                     "cores this process may use; 1 runs a single process, no supervisor)")
    # set only by the supervisor of --workers N on the processes it starts
    run.add_argument("--worker-id", type=int, default=None, help=argparse.SUPPRESS)
    run.add_argument("--worker-dir", type=Path, default=None, help=argparse.SUPPRESS)
    run.set_defaults(handler=cmd_run)


def _login_limit(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return int(text)


def _admin_users(args: argparse.Namespace) -> tuple[AdminUser, ...]:
    """--admin-users FILE (only with --admin)."""
    if args.admin_users is None:
        return ()
    if args.admin is None:
        raise ValueError("--admin-users needs --admin (the users sign in to the admin API)")
    from sandgate.admin.access import load_admin_users

    return load_admin_users(args.admin_users)


def _admin_token(args: argparse.Namespace) -> str | None:
    if args.admin_token_file is not None:
        try:
            token = str(args.admin_token_file.read_text()).strip()
        except OSError as e:
            raise ValueError(f"--admin-token-file {args.admin_token_file}: {e.strerror}") from None
        if not token:
            raise ValueError(f"--admin-token-file {args.admin_token_file} is empty")
        return token
    return os.environ.get("SANDGATE_ADMIN_TOKEN", "").strip() or None


def _check_gateway(args: argparse.Namespace, gateways: Sequence[object],
                   same_address: Callable[[tuple[str, int], tuple[str, int]], bool]) -> None:
    """--gateway and --gateway-tls-name make sense together with the other listeners."""
    if args.gateway is None:
        if args.gateway_tls_name is not None:
            raise ValueError("--gateway-tls-name needs --gateway HOST:PORT")
        return
    if same_address(args.gateway, args.listen):
        raise ValueError(f"--gateway {args.gateway[0]}:{args.gateway[1]} is the proxy "
                         "listener's address; give the gateway its own port")
    if args.admin is not None and same_address(args.gateway, args.admin):
        raise ValueError(f"--gateway {args.gateway[0]}:{args.gateway[1]} is the admin "
                         "listener's address; give the gateway its own port")
    name = args.gateway_tls_name
    if name is not None and (not name or any(c in name for c in "/@ \t")):
        raise ValueError(f"--gateway-tls-name {name!r}: expected a host name or IP address")
    if not gateways:
        raise ValueError(f"--gateway given, but {args.policies} has no `gateways:` entries; "
                         "add one, e.g. gateways: [{prefix: /anthropic, upstream: "
                         "https://api.anthropic.com, token_header: x-api-key}]")


def _instance(given: str | None) -> str:
    import socket

    name = given or os.environ.get("SANDGATE_INSTANCE") or socket.gethostname()
    return name.strip() or "sandgate"


def dns_config(args: argparse.Namespace) -> DnsConfig | None:
    """--dns and its bounds (sandgate.dns); None without --dns."""
    from sandgate.dns.bounds import DnsLimits
    from sandgate.dns.run import DnsConfig, upstream_servers

    given = [f for f, v in (("--dns-upstream", args.dns_upstream),) if v]
    if args.dns is None:
        if given:
            raise ValueError(f"{given[0]} needs --dns HOST:PORT")
        return None
    if not args.dns_rps > 0 or args.dns_burst < 1:
        raise ValueError("--dns-rps must be above 0 and --dns-burst at least 1")
    if not 0 <= args.dns_max_ttl <= 86400 or not 1 <= args.dns_max_answers <= 64:
        raise ValueError("--dns-max-ttl must be 0..86400 seconds and --dns-max-answers 1..64")
    cfg = DnsConfig(listen=args.dns, upstream=tuple(args.dns_upstream), limits=DnsLimits(
        rps=args.dns_rps, burst=args.dns_burst, max_ttl=args.dns_max_ttl,
        max_answers=args.dns_max_answers, refuse=args.dns_refuse))
    upstream_servers(cfg)  # a loop or no server at all: refused before start
    return cfg


def limits_config(args: argparse.Namespace) -> LimitsConfig:
    """The `limits` flags of `sandgate run` as a LimitsConfig (ValueError says which is wrong)."""
    from mitmproxy.utils import human

    from sandgate.limits import LimitsConfig

    def count(flag: str, value: int) -> int | None:
        if value < 0:
            raise ValueError(f"{flag} must be 0 (no limit) or more, not {value}")
        return value or None

    def seconds(flag: str, value: float) -> float | None:
        if not (value >= 0) or value == float("inf"):
            raise ValueError(f"{flag} must be 0 (off) or a number of seconds, not {value}")
        return value or None

    header_bytes = int(human.parse_size(args.max_header_bytes) or 0)
    if header_bytes < 1024:
        raise ValueError("--max-header-bytes must be at least 1k (a request line and a few "
                         "headers)")
    if args.max_headers < 8:
        raise ValueError("--max-headers must be at least 8")
    rps = seconds("--rps", args.rps)
    burst = count("--burst", args.burst)
    if burst is not None and rps is None:
        raise ValueError("--burst needs --rps")
    return LimitsConfig(
        max_header_bytes=header_bytes, max_headers=args.max_headers,
        max_connections=count("--max-connections", args.max_connections),
        max_connections_per_identity=count("--max-connections-per-identity",
                                           args.max_connections_per_identity),
        rps=rps, burst=burst,
        header_timeout=seconds("--header-timeout", args.header_timeout),
        idle_timeout=seconds("--idle-timeout", args.idle_timeout),
        upstream_connect_timeout=seconds("--upstream-connect-timeout",
                                         args.upstream_connect_timeout),
        upstream_read_timeout=seconds("--upstream-read-timeout", args.upstream_read_timeout),
        upstream_reuse_idle=seconds("--upstream-reuse-idle", args.upstream_reuse_idle),
        first_byte_timeout=seconds("--first-byte-timeout", args.first_byte_timeout),
        handshake_timeout=seconds("--handshake-timeout", args.handshake_timeout),
        identify_timeout=seconds("--identify-timeout", args.identify_timeout),
        max_unidentified_per_source=count("--max-unidentified-per-source",
                                          args.max_unidentified_per_source),
    )


def state_config(args: argparse.Namespace) -> StateConfig | None:
    """--state and its options (ValueError says which is wrong; never shows a password)."""
    from sandgate.state import StateConfig

    if args.state is None:
        for flag in ("state_password_file", "state_ca", "state_lease_kv"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --state URL")
        return None
    return StateConfig.from_url(args.state, prefix=args.state_prefix,
                                timeout=args.state_timeout, fail=args.state_fail,
                                password_file=args.state_password_file, ca_file=args.state_ca,
                                lease_kv=args.state_lease_kv)


def cmd_run(args: argparse.Namespace) -> int:
    import logging

    from sandgate.addons.pinned import check_sets
    from sandgate.mitm.pinning import check_version

    try:
        check_version()  # the one mitmproxy Sandgate's patches were checked against
        check_sets(args.sets)  # before anything heavy is imported or started
    except (ValueError, RuntimeError) as e:
        return _err(str(e))
    from sandgate.addons.lifecycle import configure_logging, default_log_format
    from sandgate.identity.agents import agents_from
    from sandgate.identity.roles import split_from
    from sandgate.mitm.guards.socks5 import parse_allow
    from sandgate.policy import live
    from sandgate.policy.loader import PolicyError
    from sandgate.runner.config import (
        RunConfig,
        banner,
        check_listeners,
        parse_resolve,
        same_address,
    )
    from sandgate.runner.serve import serve
    from sandgate.secrets.vault import VaultConfig
    from sandgate.tokens import parse_ttl

    # The policy first: a broken one is reported (located) before anything binds or prints.
    try:
        loaded = live.load(args.policies)
    except PolicyError as e:
        load_error(args.policies, e, "not starting: ")
        return 1
    admin_token = None
    try:
        if args.admin is not None:
            admin_token = _admin_token(args)
            if admin_token is None:
                raise ValueError("--admin needs a token: set SANDGATE_ADMIN_TOKEN or give "
                                 "--admin-token-file")
            if same_address(args.admin, args.listen):
                raise ValueError(f"--admin {args.admin[0]}:{args.admin[1]} is the proxy "
                                 "listener's address; give the admin listener its own port")
        _check_gateway(args, loaded.policy.gateways, same_address)
        max_ttl = parse_ttl(args.admin_max_token_ttl)
        admin_users = _admin_users(args)
        socks5_allow = parse_allow(args.socks5_allow)
        split, role_listens = split_from(args.role_listen, args.tool_identity)
        agents = agents_from(args.agent_dir, args.agent_split)
        check_listeners(RunConfig(policies=args.policies, confdir=args.confdir,
                                  listen_host=args.listen[0], listen_port=args.listen[1],
                                  admin=args.admin, socks5=args.socks5,
                                  socks5_allow=socks5_allow, role_listens=role_listens,
                                  transparent=args.transparent))
        if args.transparent is not None and not (args.identity_cidr or args.docker_network):
            raise ValueError("--transparent identifies callers by source address only (no "
                             "token travels): give --identity-cidr or --docker-network")
        if args.drain_timeout < 0:
            raise ValueError("--drain-timeout must not be negative")
        limits = limits_config(args)
        audit_settings = audit_setup.from_args(args)
        dns = dns_config(args)
        exports = export_setup.from_args(args)
        state = state_config(args)
    except ValueError as e:
        return _err(str(e))
    log_format = args.log_format or default_log_format()
    if args.worker_id is not None:
        from sandgate.addons.lifecycle import tag_logs

        tag_logs(worker=args.worker_id)
    configure_logging(log_format)
    log = logging.getLogger("sandgate")
    from sandgate.workers.listen import default_workers

    workers = args.workers or default_workers()
    role = None
    if args.worker_id is not None:
        from sandgate.workers.control import die_with_supervisor, role_from

        if args.worker_dir is None:
            return _err("--worker-id needs --worker-dir")
        try:
            role = role_from(args.worker_id, args.worker_dir)
        except ValueError as e:
            return _err(str(e))
        die_with_supervisor()
    supervising = role is None and workers > 1

    try:
        resolve = parse_resolve(args.resolve)
    except ValueError as e:
        return _err(str(e))
    for ca in args.upstream_ca:
        if not ca.is_file():
            return _err(f"--upstream-ca {ca}: no such file")
    sources: list[AddressIdentitySource] = []
    if args.address_identity_only and not args.identity_cidr:
        return _err("--address-identity-only goes with --identity-cidr")
    if args.identity_cidr:
        from sandgate.identity.cidr import parse_cidr_map

        try:
            sources.append(parse_cidr_map(args.identity_cidr, args.address_identity_only))
        except ValueError as e:
            return _err(str(e))
    dev = None
    try:
        if os.environ.get("VAULT_ADDR"):
            vault = VaultConfig.from_env()
        else:
            from sandgate.secrets.devserver import DevVault, seed_demo

            # its own process group: a terminal's Ctrl-C drains the proxy (the requests in
            # flight may still need a secret) and the server is stopped after it (below)
            dev = DevVault(own_process_group=True)
            dev.start()
            seed_demo(dev)
            log.info("sandgate: no VAULT_ADDR set; started an embedded OpenBao dev server at "
                     "%s with demo secrets", dev.addr)
            vault = VaultConfig(addr=dev.addr, token=dev.root_token, role_id=None,
                                secret_id=None, cacert=None, namespace=None)
        if args.docker_network and not supervising:  # each worker follows Docker's events
            try:
                from sandgate.identity.docker_labels import DockerLabelSource
            except ImportError as e:
                return _err(f"--docker-network needs the docker extra ({e}): "
                            "pip install 'sandgate[docker]'")

            docker_source = DockerLabelSource(networks=args.docker_network)
            docker_source.start()
            sources.append(docker_source)
        cfg = RunConfig(
            policies=args.policies, confdir=args.confdir, listen_host=args.listen[0],
            listen_port=args.listen[1], sets=args.sets, resolve=resolve,
            upstream_cas=args.upstream_ca, audit_file=args.audit, vault=vault,
            secret_ttl=args.secret_ttl, address_sources=sources,
            max_request_body=args.max_request_body, canary=args.canary,
            audit_best_effort=args.audit_best_effort,
            loaded=loaded, admin=args.admin, admin_token=admin_token,
            admin_max_token_ttl=max_ttl, drain_timeout=args.drain_timeout,
            watch_interval=None if args.no_watch else 0.5, log_format=log_format,
            socks5=args.socks5, socks5_allow=socks5_allow,
            gateway=args.gateway, gateway_tls_name=args.gateway_tls_name,
            limits=limits, split=split, role_listens=role_listens, transparent=args.transparent,
            agents=agents,
            admin_open=tuple(args.admin_open), instance=_instance(args.instance),
            audit=audit_settings,
            admin_users=admin_users,
            admin_login_limit=args.admin_login_limit,
            dns=dns,
            exports=exports,
            state=state,
        )
        if role is not None:
            cfg.worker = role
            asyncio.run(serve(cfg))
            return 0
        for line in banner(cfg, args.confdir).splitlines():
            log.info("%s", line)
        log.info("sandgate: policy version %s (%d identities; report mode: %s)", loaded.version,
                 len(loaded.policy.identities),
                 ", ".join(n for n, i in sorted(loaded.policy.identities.items())
                           if i.mode == "report") or "none")
        if supervising:
            from sandgate.workers.supervisor import Supervisor

            env = {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.token or ""} \
                if dev is not None else {}
            return asyncio.run(Supervisor(cfg, workers, args.argv, log_format, env).run())
        asyncio.run(serve(cfg))
        return 0
    except PolicyError as e:
        load_error(args.policies, e, "not starting: ")
        return 1
    except ValueError as e:
        return _err(str(e))
    except RuntimeError as e:  # DockerUnavailable, the dev Vault's `bao` missing or failing
        return _err(str(e))
    except KeyboardInterrupt:
        return 0
    finally:
        if dev is not None:
            dev.stop()
