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

    def resolve_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--resolve", action="append", default=[], metavar="HOST=IP",
                        help="judge HOST as dialling IP, as `sandgate run --resolve` does, so "
                        "the address step (private_cidrs) is checked; IP literals always are")

    def format_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--format", choices=("text", "json", "github"), default="text",
                        help="text (default), json, or GitHub Actions annotations")

    check = sub.add_parser("check", help="validate policies and run their tests: fixtures")
    check.add_argument("policies", type=Path)
    resolve_arg(check)
    format_arg(check)

    lint = sub.add_parser("lint", help="warn about policies that load but may not do what "
                          "they say")
    lint.add_argument("policies", type=Path)
    lint.add_argument("--strict", action="store_true", help="exit 1 on any warning")
    format_arg(lint)

    explain = sub.add_parser("explain", help="show the decision for one request")
    explain.add_argument("--policies", type=Path, default=Path("policies"))
    explain.add_argument("--identity", required=True)
    resolve_arg(explain)
    explain.add_argument("method", help="an HTTP method, or CONNECT for a tunnel")
    explain.add_argument("url", help="an absolute http(s) URL, or host:port after CONNECT")

    token = sub.add_parser("token", help="proxy tokens")
    tsub = token.add_subparsers(dest="token_command", required=True)
    issue = tsub.add_parser("issue", help="print a signed proxy token")
    issue.add_argument("--identity", required=True)
    issue.add_argument("--sandbox", default=None)
    issue.add_argument("--ttl", default="1h", help="30s, 15m, 1h, 7d")
    issue.add_argument("--policies", type=Path, default=None, metavar="DIR",
                       help="refuse an identity this policy directory does not define "
                       "(without it no check is possible: tokens are signed, not looked up)")
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
        "lint": cmd_lint,
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


def _resolve(specs: Sequence[str]) -> dict[str, str]:
    from sandgate.runner import parse_resolve

    return parse_resolve(specs)


def cmd_check(args: argparse.Namespace) -> int:
    from sandgate.policy.fixtures import run_policy_tests
    from sandgate.policy.lint import findings_from_error, github_annotation
    from sandgate.policy.loader import PolicyError, discover_policy_files, load_policy_dir

    try:
        resolve = _resolve(args.resolve)
    except ValueError as e:
        return _err(str(e))
    fmt = args.format
    read, skipped = discover_policy_files(args.policies)
    doc: dict[str, object] = {
        "files_read": [str(path) for path in read],
        "files_skipped": [{"file": name, "reason": why} for name, why in skipped],
    }
    if fmt == "text":
        for path in read:
            print(f"read {path}")
        for name, why in skipped:
            print(f"skipped {name}: {why}")
    try:
        policy = load_policy_dir(args.policies)
    except PolicyError as e:
        problems = findings_from_error(e)
        if fmt == "json":
            doc.update(problems=[p.as_dict() for p in problems], fixtures=[], passed=0,
                       failed=0)
            print(json.dumps(doc, indent=2))
        elif fmt == "github":
            for p in problems:
                print(github_annotation("error", p.file, p.line, p.text))
        else:
            print(f"sandgate: {len(e.problems)} problem(s) in {args.policies}:", file=sys.stderr)
            print(str(e), file=sys.stderr)
        return 1
    results = run_policy_tests(policy, resolve)
    failed = [r for r in results if not r.passed]
    summary = (f"{len(policy.files)} file(s), {len(policy.identities)} identities, "
               f"{len(policy.secrets)} secrets; {len(results) - len(failed)} passed, "
               f"{len(failed)} failed")
    if fmt == "json":
        doc["problems"] = []
        doc["fixtures"] = [{
            "file": r.test.source.file, "line": r.test.source.line,
            "identity": r.test.identity, "request": f"{r.test.method} {r.test.url}",
            "expect": r.test.expect, "got": "allow" if r.decision.allowed else "deny",
            "rule": r.decision.rule_name,
            "code": str(r.decision.code) if r.decision.code else None,
            "inject": sorted(r.secrets), "passthrough": r.passthrough, "address": r.address,
            "passed": r.passed, "message": r.message,
        } for r in results]
        doc["passed"] = len(results) - len(failed)
        doc["failed"] = len(failed)
        print(json.dumps(doc, indent=2))
        return 1 if failed else 0
    for r in results:
        if fmt == "github":
            if not r.passed:
                print(github_annotation(
                    "error", r.test.source.file, r.test.source.line,
                    f"{r.test.identity} {r.test.method} {r.test.url}: {r.message}"))
            continue
        mark = "ok  " if r.passed else "FAIL"
        addr = f" [{r.address}]" if r.address and r.address.startswith(("dials", "refused")) \
            else ""
        print(f"{mark} {r.test.source}: {r.test.identity} {r.test.method} {r.test.url} "
              f"-> {'allow' if r.decision.allowed else 'deny'}"
              f" ({r.decision.rule_name or r.decision.code}){addr}"
              f"{'' if r.passed else ': ' + r.message}")
    print(summary)
    return 1 if failed else 0


def cmd_lint(args: argparse.Namespace) -> int:
    from sandgate.policy.lint import findings_from_error, format_findings, lint_dir
    from sandgate.policy.loader import PolicyError

    try:
        findings = lint_dir(args.policies)
    except PolicyError as e:
        errors = findings_from_error(e)
        print(format_findings(errors, args.format))
        if args.format == "text":
            print(f"sandgate: {len(errors)} load error(s) in {args.policies}", file=sys.stderr)
        return 1
    text = format_findings(findings, args.format)
    if text:
        print(text)
    if args.format == "text":
        print(f"sandgate: {len(findings)} warning(s) in {args.policies}", file=sys.stderr)
    return 1 if findings and args.strict else 0


def cmd_explain(args: argparse.Namespace) -> int:
    from sandgate.decision import judge
    from sandgate.policy.loader import PolicyError, load_policy_dir

    try:
        resolve = _resolve(args.resolve)
    except ValueError as e:
        return _err(str(e))
    try:
        policy = load_policy_dir(args.policies)
    except PolicyError as e:
        print(str(e), file=sys.stderr)
        return 1
    try:
        v = judge(policy, args.identity, args.method, args.url, resolve)
    except ValueError as e:
        return _err(f"bad request: {e}")
    d = v.decision
    out: dict[str, object] = {
        "identity": args.identity,
        "request": v.request,
        "decision": "allow" if d.allowed else "deny",
        "rule": d.rule_name,
        "rule_source": str(d.rule.source) if d.rule else None,
        "code": str(d.code) if d.code else None,
        "reason": d.reason,
        "hint": d.hint,
        "detail": d.detail,
        "address": v.address,
    }
    if v.connect:
        out["passthrough"] = v.passthrough
    if d.allowed and d.rule is not None and not v.connect:
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
    if d.rule is not None:
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
    if args.policies is not None:
        from sandgate.policy.loader import PolicyError, load_policy_dir

        try:
            policy = load_policy_dir(args.policies)
        except PolicyError as e:
            print(f"sandgate: {len(e.problems)} problem(s) in {args.policies}:", file=sys.stderr)
            print(str(e), file=sys.stderr)
            return 1
        if args.identity not in policy.identities:
            known = ", ".join(sorted(policy.identities)) or "(none)"
            print(f"sandgate: identity {args.identity!r} is not defined in {args.policies}; "
                  f"known identities: {known}", file=sys.stderr)
            return 1
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
