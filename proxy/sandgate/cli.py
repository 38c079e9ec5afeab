"""`sandgate`: run the proxy, check and explain policies, issue tokens, print the CA."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sandgate import __version__
from sandgate.identity.base import AddressIdentitySource

DEFAULT_CONFDIR = Path(os.environ.get("SANDGATE_CONFDIR", "~/.sandgate")).expanduser()


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandgate", description=__doc__)
    p.add_argument("--version", action="version", version=f"sandgate {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def confdir_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--confdir", type=Path, default=DEFAULT_CONFDIR,
                        help="holds the CA and the token signing key (default %(default)s)")

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
    run.add_argument("--secret-ttl", type=float, default=300.0, metavar="SECONDS")
    run.add_argument("--max-request-body", type=_size, default="32m", metavar="SIZE",
                     help="refuse request bodies larger than this with 413 (default %(default)s; "
                     "bodies are buffered to be inspected before anything is sent)")
    run.add_argument("--canary", action="store_true",
                     help="refuse and audit any request carrying an identity's decoy credential "
                     "(see `sandgate canary`); scrub it from responses")
    run.add_argument("--identity-cidr", action="append", default=[],
                     metavar="CIDR=IDENTITY[/SANDBOX]",
                     help="identify clients from this range without a token (VMs, namespaces)")
    run.add_argument("--docker-network", action="append", default=[], metavar="NAME",
                     help="identify clients on this Docker network by their container labels")

    check = sub.add_parser("check", help="validate policies and run their tests: fixtures")
    check.add_argument("policies", type=Path)

    explain = sub.add_parser("explain", help="show the decision for one request")
    explain.add_argument("--policies", type=Path, default=Path("policies"))
    explain.add_argument("--identity", required=True)
    explain.add_argument("method")
    explain.add_argument("url")

    token = sub.add_parser("token", help="proxy tokens")
    tsub = token.add_subparsers(dest="token_command", required=True)
    issue = tsub.add_parser("issue", help="print a signed proxy token")
    issue.add_argument("--identity", required=True)
    issue.add_argument("--sandbox", default=None)
    issue.add_argument("--ttl", default="1h", help="30s, 15m, 1h, 7d")
    confdir_arg(issue)

    can = sub.add_parser("canary", help="print an identity's decoy credential (for --canary)")
    can.add_argument("--identity", required=True)
    confdir_arg(can)

    ca = sub.add_parser("ca", help="print the CA certificate sandboxes must trust")
    confdir_arg(ca)

    sub.add_parser("schema", help="print the JSON Schema of the policy format")

    try:
        from sandgate.sandbox import cli as sandbox_cli
    except ImportError as e:  # the docker extra is not installed: say so when it is asked for
        missing = sub.add_parser("sandbox", help="Docker sandboxes (needs sandgate[docker])")
        missing.set_defaults(missing_extra=f"{e}; install it with: pip install 'sandgate[docker]'")
        missing.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        sandbox_cli.add_parser(sub, confdir_arg)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `sandgate ca | head`: the reader is done, so are we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    handler = {
        "run": cmd_run,
        "check": cmd_check,
        "explain": cmd_explain,
        "token": cmd_token,
        "ca": cmd_ca,
        "canary": cmd_canary,
        "schema": cmd_schema,
    }.get(args.command)
    if getattr(args, "missing_extra", None):
        return _err(args.missing_extra)
    if handler is None:
        from sandgate.sandbox import cli as sandbox_cli

        return int(sandbox_cli.run(args))
    return int(handler(args))


def _err(msg: str) -> int:
    print(f"sandgate: {msg}", file=sys.stderr)
    return 2


def cmd_check(args: argparse.Namespace) -> int:
    from sandgate.policy.fixtures import run_policy_tests
    from sandgate.policy.loader import PolicyError, load_policy_dir

    try:
        policy = load_policy_dir(args.policies)
    except PolicyError as e:
        print(f"sandgate: {len(e.problems)} problem(s) in {args.policies}:", file=sys.stderr)
        print(str(e), file=sys.stderr)
        return 1
    from sandgate.policy.proofs import ProofError, prove

    try:
        proofs = prove(policy)
    except ProofError as e:  # the prover and decide() disagree: a bug, never a verdict
        return _err(f"internal error in the policy prover: {e}")
    for pr in proofs:
        print(pr)
    results = run_policy_tests(policy)
    failed = [r for r in results if not r.passed]
    for r in results:
        mark = "ok  " if r.passed else "FAIL"
        print(f"{mark} {r.test.source}: {r.test.identity} {r.test.method} {r.test.url} "
              f"-> {'allow' if r.decision.allowed else 'deny'}"
              f" ({r.decision.rule_name or r.decision.code}){'' if r.passed else ': ' + r.message}")
    ids = len(policy.identities)
    print(f"{len(policy.files)} file(s), {ids} identities, {len(policy.secrets)} secrets; "
          f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not all(pr.ok for pr in proofs) else 0


def cmd_explain(args: argparse.Namespace) -> int:
    from sandgate.decision import decide
    from sandgate.policy.loader import PolicyError, load_policy_dir
    from sandgate.request import parse_url

    try:
        policy = load_policy_dir(args.policies)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    try:
        req = parse_url(args.method, args.url)
    except ValueError as e:
        return _err(f"bad request: {e}")
    d = decide(policy, args.identity, req)
    out: dict[str, object] = {
        "identity": args.identity,
        "request": f"{req.method} {req.target}",
        "decision": "allow" if d.allowed else "deny",
        "rule": d.rule_name,
        "rule_source": str(d.rule.source) if d.rule else None,
        "code": str(d.code) if d.code else None,
        "reason": d.reason,
        "hint": d.hint,
        "detail": d.detail,
    }
    if d.allowed and d.rule is not None:
        inj = d.rule.inject
        would: list[str] = []
        if inj is not None:
            would += [f"header {n}: from secret(s) {', '.join(sorted(t.secrets)) or '-'}"
                      for n, t in inj.headers]
            if inj.basic is not None:
                s = inj.basic[0].secrets | inj.basic[1].secrets
                would.append(f"basic auth: from secret(s) {', '.join(sorted(s))}")
            would += [f"query {n}: from secret(s) {', '.join(sorted(t.secrets))}"
                      for n, t in inj.query]
        out["inject"] = would
        out["placeholders_honoured"] = sorted(d.rule.secrets)
        out["private_cidrs"] = [str(n) for n in d.rule.private_cidrs]
    print(json.dumps(out, indent=2))
    return 0 if d.allowed else 1


def cmd_token(args: argparse.Namespace) -> int:
    from sandgate import confdir
    from sandgate.tokens import issue_token, parse_ttl

    try:
        ttl = parse_ttl(args.ttl)
    except ValueError as e:
        return _err(str(e))
    key = confdir.token_key(confdir.ensure_confdir(args.confdir))
    print(issue_token(key, args.identity, args.sandbox, ttl))
    return 0


def cmd_canary(args: argparse.Namespace) -> int:
    from sandgate import confdir
    from sandgate.tokens import canary

    print(canary(confdir.token_key(confdir.ensure_confdir(args.confdir)), args.identity))
    return 0


def cmd_ca(args: argparse.Namespace) -> int:
    from sandgate import confdir

    path = confdir.ensure_ca(confdir.ensure_confdir(args.confdir))
    sys.stdout.write(Path(path).read_text())
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from sandgate.policy.loader import policy_json_schema

    print(json.dumps(policy_json_schema(), indent=2))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from sandgate.addons.pinned import check_sets
    from sandgate.policy.loader import PolicyError
    from sandgate.runner import RunConfig, banner, parse_resolve, serve
    from sandgate.secrets.vault import VaultConfig

    try:
        resolve = parse_resolve(args.resolve)
        check_sets(args.sets)
    except ValueError as e:
        return _err(str(e))
    for ca in args.upstream_ca:
        if not ca.is_file():
            return _err(f"--upstream-ca {ca}: no such file")
    sources: list[AddressIdentitySource] = []
    if args.identity_cidr:
        from sandgate.identity.cidr import parse_cidr_map

        try:
            sources.append(parse_cidr_map(args.identity_cidr))
        except ValueError as e:
            return _err(str(e))
    dev = None
    try:
        if os.environ.get("VAULT_ADDR"):
            vault = VaultConfig.from_env()
        else:
            from sandgate.secrets.devserver import DevVault, seed_demo

            dev = DevVault()
            dev.start()
            seed_demo(dev)
            print(f"sandgate: no VAULT_ADDR set; started an embedded OpenBao dev server at "
                  f"{dev.addr} with demo secrets", file=sys.stderr)
            vault = VaultConfig(addr=dev.addr, token=dev.root_token, role_id=None,
                                secret_id=None, cacert=None, namespace=None)
        if args.docker_network:
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
        )
        print(banner(cfg, args.confdir), file=sys.stderr, end="")
        asyncio.run(serve(cfg))
        return 0
    except PolicyError as e:
        print(f"sandgate: not starting: {len(e.problems)} problem(s) in {args.policies}:",
              file=sys.stderr)
        print(str(e), file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
