"""Credentials a sandbox holds or trusts: `token issue`, `canary` (a decoy), `ca`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sandgate.cli.common import confdir_arg, load_error
from sandgate.cli.common import err as _err


def register(sub: Any) -> None:
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
    token.set_defaults(handler=cmd_token)

    can = sub.add_parser("canary", help="print an identity's decoy credential (for --canary)")
    can.add_argument("--identity", required=True)
    confdir_arg(can)
    can.set_defaults(handler=cmd_canary)

    ca = sub.add_parser("ca", help="print the CA certificate sandboxes must trust")
    confdir_arg(ca)
    ca.add_argument("--rotate", action="store_true",
                    help="replace the CA with a new ECDSA P-256 one first (the old files are "
                         "kept as *.old; restart the proxy, sandboxes must trust the new one)")
    ca.set_defaults(handler=cmd_ca)


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
            load_error(args.policies, e)
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

    conf = confdir.ensure_confdir(args.confdir)
    if getattr(args, "rotate", False):
        path = confdir.rotate_ca(conf)
        from sandgate.cakey import key_kind

        print(f"new CA ({key_kind(conf / confdir.CA_KEY_FILE)}); old files kept as *.old: "
              "restart the proxy, and have sandboxes trust this certificate", file=sys.stderr)
    else:
        path = confdir.ensure_ca(conf)
    sys.stdout.write(Path(path).read_text())
    return 0
