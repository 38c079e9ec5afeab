"""`sandgate sandbox ...`: run commands in sandboxes whose only way out is Sandgate.

    sandgate sandbox network [--proxy-port 8080]       create the internal network, print gateway
                     [--unsafe-allow-host-services]     (sandboxes then reach every host port)
    sandgate sandbox run --identity NAME [...] -- CMD   one command in a fresh sandbox, then remove
                     [--pattern1]                       ... as the agent of a split sandbox
                     --agent NAME [--cli-dir DIR] -- CMD  a coding agent, with the process split
    sandgate sandbox ls                                 sandboxes the launcher created
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandgate.capture import nftables as capture
from sandgate.capture.nftables import CaptureError
from sandgate.cli import capture as capture_cli
from sandgate.identity.labels import LABEL_IDENTITY, LABEL_SANDBOX
from sandgate.sandbox import agent_profiles as agents
from sandgate.sandbox import split
from sandgate.sandbox.engine import DockerUnavailable, SandboxError, connect
from sandgate.sandbox.launcher import (
    DEFAULT_IMAGE,
    ExecResult,
    SandboxSpec,
    list_sandboxes,
    run_once,
)
from sandgate.sandbox.network import (
    DEFAULT_SUBNET,
    NETWORK_NAME,
    SandboxNetwork,
    ensure_network_info,
    inspect_network,
)


def add_parser(sub: Any, confdir_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("sandbox", help="run commands in Docker sandboxes behind Sandgate")
    ssub = p.add_subparsers(dest="sandbox_command", required=True)

    def net_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--network", default=NETWORK_NAME)
        sp.add_argument("--subnet", default=DEFAULT_SUBNET)
        sp.add_argument("--proxy-port", type=int, default=8080,
                        help="the port Sandgate listens on at the gateway (default %(default)s)")
        sp.add_argument("--unsafe-allow-host-services", action="store_true",
                        help="host firewall: let sandboxes reach EVERY port of the host at the "
                             "gateway address, not only the proxy port (unsafe: any service "
                             "listening on the host answers them)")
        # The default since the host firewall allows only the proxy port; kept for old scripts.
        sp.add_argument("--only-proxy-port", action="store_true", help=argparse.SUPPRESS)
        sp.add_argument("--transparent", type=int, default=None, metavar="PORT",
                        help="transparent capture: redirect the sandboxes' TCP to 80/443 (and "
                        "--capture-port) to Sandgate's --transparent listener at this port of "
                        "the gateway, drop and count everything else (nftables); `run`: no "
                        "proxy variables in the sandbox")
        sp.add_argument("--dns", default=None, metavar="ADDRESS",
                        help="the policy DNS's address (sandgate run --dns ADDRESS:53): the "
                        "sandbox's only resolver (docs/dns.md); with --transparent every other "
                        "DNS packet is dropped and counted")
        capture_cli.add_arguments(sp, status=sp.prog.endswith(" network"), dns=False)

    net = ssub.add_parser("network", help="create the internal sandbox network; print gateway")
    net_args(net)

    run = ssub.add_parser("run", help="run one command in a fresh sandbox, then remove it")
    run.add_argument("--identity", default=None,
                     help="the sandbox's identity (required; with --agent: the agent's, default "
                     "its name)")
    run.add_argument("--agent", default=None, metavar="NAME",
                     help=f"start coding agent NAME ({', '.join(agents.PROFILES)}) with the "
                     "process split: only its own process has its identity, everything it "
                     "starts the tool identity; its variables, settings files and policy "
                     "template (docs/agents.md). Sandgate runs on this host with --agent-dir "
                     "and --agent-split NAME=NAME-tool")
    run.add_argument("--tool-identity", default=None,
                     help="--agent: the identity of everything the agent starts (default "
                     "NAME-tool; must match sandgate run --agent-split)")
    run.add_argument("--agent-dir", type=Path, default=None, metavar="DIR",
                     help="--agent: Sandgate's --agent-dir, where the agent's host pid is "
                     "registered (default $SANDGATE_AGENT_DIR or /run/sandgate/agents)")
    run.add_argument("--cli-dir", type=Path, default=None, metavar="DIR",
                     help="--agent: a node_modules directory with the pinned agent CLIs (npm ci "
                     f"of tests/agents), mounted read-only at {agents.CLI_MOUNT}; the agent's "
                     "command name (claude, codex, gemini, opencode) runs its own binary there")
    run.add_argument("--allow-ptrace", action="store_true",
                     help="--agent: start even without Yama ptrace_scope >= 1 (the agent's "
                     "children could then drive its process)")
    run.add_argument("--image", default=None, help=f"default {DEFAULT_IMAGE}; with --pattern1 "
                     f"{split.IMAGE}")
    run.add_argument("--pattern1", action="store_true",
                     help="the agent runs in the sandbox, its bash tool (sandgate-tool) as "
                     "another user whose traffic reaches Sandgate's tool listener "
                     "(docs/pattern1.md)")
    run.add_argument("--tool-port", type=int, default=split.SplitPorts().tool_port,
                     help="--pattern1: Sandgate's tool listener port (default %(default)s)")
    run.add_argument("--other-port", type=int, default=split.SplitPorts().other_port,
                     help="--pattern1: Sandgate's other listener port (default %(default)s)")
    run.add_argument("--proxy-url", default=None,
                     help="default: http://<gateway of the network>:<proxy-port>")
    run.add_argument("--ttl", default="1h", help="proxy token lifetime (30s, 15m, 1h)")
    run.add_argument("--no-token", action="store_true",
                     help="no proxy token: rely on the proxy's --docker-network identification")
    run.add_argument("--placeholder", action="append", default=[], metavar="NAME=VALUE",
                     help="environment placeholder, e.g. ANTHROPIC_API_KEY=sandgate-placeholder-"
                          "anthropic")
    run.add_argument("--memory", default="512m")
    run.add_argument("--cpus", type=float, default=1.0)
    run.add_argument("--pids-limit", type=int, default=256)
    run.add_argument("--timeout", type=float, default=120)
    net_args(run)
    confdir_arg(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")

    ssub.add_parser("ls", help="list sandboxes the launcher created")


def _network(client: Any, args: argparse.Namespace) -> SandboxNetwork:
    if args.unsafe_allow_host_services and args.only_proxy_port:
        raise SandboxError("--unsafe-allow-host-services and --only-proxy-port contradict")
    return ensure_network_info(client, args.network, args.subnet, proxy_port=args.proxy_port,
                               allow_host_services=args.unsafe_allow_host_services,
                               transparent=capture_cli.for_network(args))


def _err(msg: str) -> int:
    print(f"sandgate: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        if args.sandbox_command == "network":
            client = connect()
            if args.status:  # the capture counters of the network's bridge
                bridge = inspect_network(client, args.network).bridge
                sys.stdout.write(capture.format_counters(capture.counters(bridge)))
                return 0
            info = _network(client, args)
            if not info.host_firewall:
                print("sandgate: warning: no host firewall (not root?): sandboxes can reach "
                      "every address and port of this host", file=sys.stderr)
            print(info.gateway)
            return 0
        if args.sandbox_command == "ls":
            for c in list_sandboxes(connect()):
                labels = c.labels
                print(f"{labels.get(LABEL_SANDBOX, '-')}\t{labels.get(LABEL_IDENTITY, '-')}\t"
                      f"{c.status}\t{c.name}")
            return 0
        if args.sandbox_command == "run":
            return _run(args)
    except DockerUnavailable as e:
        return _err(str(e))
    except (SandboxError, CaptureError) as e:
        return _err(str(e))
    return _err(f"unknown sandbox command {args.sandbox_command!r}")


def _run(args: argparse.Namespace) -> int:
    import secrets

    from sandgate import confdir
    from sandgate.tokens import issue_token, parse_ttl

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        return _err("sandbox run: no command (sandgate sandbox run --identity X -- CMD ...)")
    profile = None
    if args.agent is not None:
        try:
            profile = agents.profile(args.agent)
        except ValueError as e:
            return _err(str(e))
        if args.pattern1:
            return _err("--agent starts the process split; --pattern1 is the uid split of "
                        "the agent image (docs/pattern1.md): give one of them")
        args.identity = args.identity or profile.identity
    elif args.identity is None:
        return _err("sandbox run: --identity NAME (or --agent NAME) is required")
    elif args.cli_dir is not None or args.tool_identity is not None:
        return _err("--cli-dir and --tool-identity go with --agent NAME")
    placeholders: dict[str, str] = {}
    for item in args.placeholder:
        name, sep, value = item.partition("=")
        if not sep or not name:
            return _err(f"--placeholder {item!r}: expected NAME=VALUE")
        placeholders[name] = value
    mounts: dict[str, str] = {}
    if profile is not None:
        placeholders = {**profile.env, **placeholders}
        if args.cli_dir is not None:
            if not args.cli_dir.is_dir():
                return _err(f"--cli-dir {args.cli_dir}: not a directory (npm ci in tests/agents "
                            "makes one: tests/agents/node_modules)")
            mounts[str(args.cli_dir.resolve())] = agents.CLI_MOUNT
        problem = _agent_host_problem(args)
        if problem:
            return _err(problem)
    client = connect()
    info = _network(client, args)
    directory = confdir.ensure_confdir(Path(args.confdir))
    ca_pem = Path(confdir.ensure_ca(directory)).read_text()
    sandbox_id = f"sbx-{secrets.token_hex(6)}"
    token = None
    if not args.no_token:
        try:
            ttl = parse_ttl(args.ttl)
        except ValueError as e:
            return _err(str(e))
        token = issue_token(confdir.token_key(directory), args.identity, sandbox_id, ttl)
    spec = SandboxSpec(
        identity=args.identity, sandbox_id=sandbox_id,
        image=args.image or (split.IMAGE if args.pattern1 else DEFAULT_IMAGE),
        split=split.SplitPorts(args.tool_port, args.other_port) if args.pattern1 else None,
        proxy_url=args.proxy_url or f"http://{info.gateway}:{args.proxy_port}",
        ca_pem=ca_pem, token=token, placeholders=placeholders, memory=args.memory,
        cpus=args.cpus, pids_limit=args.pids_limit, network=args.network,
        allow_host_services=args.unsafe_allow_host_services, dns=args.dns,
        transparent=args.transparent is not None, mounts=mounts,
    )
    if profile is not None:
        from sandgate.sandbox.agentrun import run_agent

        res = run_agent(client, spec, profile, args.tool_identity or profile.tool_identity, cmd,
                        agent_dir=_agent_dir(args), timeout=args.timeout)
        return _finish(res, args.timeout)
    res = run_once(client, spec, cmd if len(cmd) > 1 else cmd[0], timeout=args.timeout)
    return _finish(res, args.timeout)


def _agent_dir(args: argparse.Namespace) -> Path:
    if args.agent_dir is not None:
        return Path(args.agent_dir)
    return Path(os.environ.get("SANDGATE_AGENT_DIR", "/run/sandgate/agents"))


def _agent_host_problem(args: argparse.Namespace) -> str | None:
    """Why the process split would not hold on this host (None: it would)."""
    from sandgate.cli.agent import ptrace_scope

    scope = ptrace_scope()
    if (scope is None or scope < 1) and not args.allow_ptrace:
        return ("kernel.yama.ptrace_scope is " + ("absent" if scope is None else str(scope)) +
                ": the agent's children could ptrace the agent and open connections as it. "
                "Set it to 1 (sysctl kernel.yama.ptrace_scope=1) or pass --allow-ptrace")
    if os.geteuid() != 0:
        return ("--agent: the launcher registers the agent's host pid in Sandgate's agent "
                "directory and reads /proc of the sandbox's processes: run it as root")
    return None


def _finish(res: ExecResult, timeout: float) -> int:
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.timed_out:
        print(f"sandgate: timed out after {timeout:g} s", file=sys.stderr)
    return res.exit_code if res.exit_code >= 0 else 124
