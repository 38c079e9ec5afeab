"""`sandgate approvals list|show|approve|deny|watch`: decide `action: ask` requests from a
terminal, through the admin API (GET/POST /v1/approvals, sandgate.approvals.api).

The admin URL comes from --admin (or SANDGATE_ADMIN_URL), the token from --token-file (or
SANDGATE_ADMIN_TOKEN): the approver is whoever that token belongs to (--admin-users), never a
name given here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sandgate.cli.common import err
from sandgate.errors import Unavailable
from sandgate.text import printable

SCOPES = ("request", "sandbox", "identity")


def register(sub: Any) -> None:
    a = sub.add_parser("approvals", help="list, show, approve, deny and watch the requests "
                       "`action: ask` rules hold (through the admin API)")
    a.add_argument("--admin", default=None, metavar="URL",
                   help="the admin API, e.g. http://127.0.0.1:9090 (default: env "
                   "SANDGATE_ADMIN_URL)")
    a.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                   help="your admin API token (default: env SANDGATE_ADMIN_TOKEN)")
    a.add_argument("--json", action="store_true", help="print JSON")
    asub = a.add_subparsers(dest="approvals_command", required=True)
    asub.add_parser("list", help="pending approvals, oldest first")
    show = asub.add_parser("show", help="one approval, in any state")
    show.add_argument("id")
    for verb in ("approve", "deny"):
        d = asub.add_parser(verb, help=f"{verb} a pending approval (as your token's user)")
        d.add_argument("id")
        d.add_argument("--note", default=None, help="why (kept in the audit)")
        if verb == "approve":
            d.add_argument("--scope", choices=SCOPES, default="request",
                           help="remember the approval for this request only (default), the "
                           "caller's sandbox, or its identity (the rule's `remember` says "
                           "which it allows)")
            d.add_argument("--ttl", default=None, metavar="DURATION",
                           help="how long a sandbox/identity scope lasts: 30m, 8h, 1d")
    w = asub.add_parser("watch", help="print each new pending approval as it arrives")
    w.add_argument("--interval", type=float, default=1.0, metavar="SECONDS")
    w.add_argument("--count", type=int, default=None, metavar="N",
                   help="exit after N approvals (default: until interrupted)")
    a.set_defaults(handler=cmd_approvals)


class ApiError(Unavailable):
    pass


def _client(args: argparse.Namespace) -> tuple[str, str]:
    url = args.admin or os.environ.get("SANDGATE_ADMIN_URL")
    if not url:
        raise ApiError("give --admin URL (or set SANDGATE_ADMIN_URL)")
    if not url.startswith(("http://", "https://")):
        raise ApiError(f"--admin {url!r} is not an http:// or https:// URL")
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            raise ApiError(f"--token-file {args.token_file}: {e.strerror}") from None
    else:
        token = os.environ.get("SANDGATE_ADMIN_TOKEN", "")
    if not token:
        raise ApiError("give --token-file FILE (or set SANDGATE_ADMIN_TOKEN)")
    return url.rstrip("/"), token


def _call(args: argparse.Namespace, method: str, path: str,
          body: dict[str, Any] | None = None) -> Any:
    url, token = _client(args)
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method,  # noqa: S310 (http(s))
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 (checked: http(s))
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            doc = json.loads(e.read())
            why = f"{doc.get('error')}: {doc.get('reason')}"
        except ValueError:
            why = f"HTTP {e.code}"
        raise ApiError(f"{method} {path}: {why}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ApiError(f"cannot reach the admin API at {url}: {e}") from None


def line(a: dict[str, Any]) -> str:
    """One approval on one line: id, who, what, which rule, what it still needs."""
    who = a["identity"] + (f"/{a['sandbox']}" if a.get("sandbox") else "")
    tool = f" tool={a['tool']}" if a.get("tool") else ""
    votes = f" {len(a.get('approved_by', []))}/{a['require_approvers']}"
    left = max(0, round(a["expires"] - time.time()))
    state = a["state"] if a["state"] != "pending" else f"pending {left}s"
    return printable(f"{a['id']}  {who}  {a['method']} {a['url']}  rule={a['rule']}{tool}  "
                     f"body={a['body_size']}B{votes}  {state}")


def header_lines(a: dict[str, Any]) -> list[str]:
    """The headers the approval binds (scrubbed by Sandgate), one per indented line, and the
    ones Sandgate injects by name only; control characters escaped for the terminal."""
    out = [printable(f"    {n}: {v}") for n, v in a.get("headers", [])]
    out += [printable(f"    {n}: [injected by Sandgate]") for n in a.get("headers_injected", [])]
    if a.get("headers_sha256"):
        out.append(f"    (headers sha256 {a['headers_sha256'][:16]}...)")
    return out


def _print(args: argparse.Namespace, a: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(a), flush=True)
        return
    print("\n".join([line(a), *header_lines(a)]), flush=True)


def _ttl(text: str | None) -> int | None:
    if text is None:
        return None
    from sandgate.tokens import parse_ttl

    return parse_ttl(text)


def cmd_approvals(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ApiError, ValueError) as e:
        return err(str(e))
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    cmd = args.approvals_command
    if cmd == "list":
        items = _call(args, "GET", "/v1/approvals")["approvals"]
        if args.json:
            print(json.dumps(items, indent=2))
        elif not items:
            print("no pending approvals")
        for a in items if not args.json else ():
            _print(args, a)
        return 0
    if cmd == "show":
        a = _call(args, "GET", f"/v1/approvals/{args.id}")
        print(json.dumps(a, indent=2))
        return 0
    if cmd in ("approve", "deny"):
        body: dict[str, Any] = {"decision": cmd}
        if cmd == "approve":
            ttl = _ttl(args.ttl)
            if args.scope == "request" and ttl is not None:
                raise ApiError("--ttl applies to --scope sandbox or identity")
            body["scope"] = {"kind": args.scope, **({"ttl": ttl} if ttl else {})}
        if args.note:
            body["note"] = args.note
        a = _call(args, "POST", f"/v1/approvals/{args.id}", body)
        if args.json:
            print(json.dumps(a))
        else:
            need = a["require_approvers"] - len(a.get("approved_by", []))
            more = f" (needs {need} more approver(s))" if a["state"] == "pending" else ""
            print(f"{a['id']}: {a['state']}{more}")
        return 0
    return _watch(args)


def _watch(args: argparse.Namespace) -> int:
    """Poll the pending list and print each approval the first time it is seen: works the same
    against one process, a workers' front or a replica sharing Redis."""
    seen: set[str] = set()
    shown = 0
    while args.count is None or shown < args.count:
        for a in _call(args, "GET", "/v1/approvals")["approvals"]:
            if a["id"] in seen:
                continue
            seen.add(a["id"])
            _print(args, a)
            shown += 1
            if args.count is not None and shown >= args.count:
                break
        else:
            time.sleep(max(0.1, args.interval))
    sys.stdout.flush()
    return 0
