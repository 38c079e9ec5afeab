"""`sandgate audit`: check the audit stream's hash chain (verify), print the signing key."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sandgate.cli.common import confdir_arg
from sandgate.cli.common import err as _err


def register(sub: Any) -> None:
    p = sub.add_parser("audit", help="verify audit files (hash chain, signed checkpoints)")
    asub = p.add_subparsers(dest="audit_command", required=True)
    v = asub.add_parser(
        "verify", help="check audit files: OK with counts (exit 0), the first edited, "
        "reordered or deleted line (exit 1), or what is missing from the set: a run, a "
        "worker's share, the end of a chain, an unstated mid-history start (exit 3)")
    v.add_argument("files", nargs="+", type=Path, metavar="FILE",
                   help="audit files, oldest first (rotated files, then the current one)")
    v.add_argument("--public-key", type=Path, default=None, metavar="FILE",
                   help="the checkpoints must be signed by this key (PEM, or the hex that "
                   "`sandgate audit public-key` prints)")
    v.add_argument("--after", action="append", default=[], metavar="SHA256",
                   help="the files legitimately begin after the line with this hash (an "
                   "export, a rotated file kept elsewhere): the hash the report names; "
                   "repeat for each chain that begins mid-history")
    v.add_argument("--anchor", type=Path, default=None, metavar="FILE",
                   help="the signed anchor the proxy keeps in its confdir "
                   "(CONFDIR/audit-anchor.*.json): every chain of the latest run must reach "
                   "the head it names (a last run or a chain's end deleted is reported)")
    v.add_argument("--confdir", type=Path, default=None, metavar="DIR",
                   help="take the anchor of the last FILE from this confdir (as --anchor)")
    v.add_argument("--live", action="store_true",
                   help="the last file is still being written: lines after its chains' last "
                   "checkpoints are reported, not a failure")
    k = asub.add_parser("public-key", help="print the public half of the confdir's audit "
                        "signing key (hex), for `audit verify --public-key`")
    confdir_arg(k)
    p.set_defaults(handler=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    if args.audit_command == "verify":
        return cmd_verify(args)
    return cmd_public_key(args)


def read_public_key(path: Path) -> str:
    """The raw Ed25519 public key (hex) from a PEM file or a file holding the hex."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from sandgate.audit.chain import public_hex

    raw = path.read_bytes().strip()
    if raw.startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(raw)
        except ValueError:
            raise ValueError(f"--public-key {path}: not a readable PEM public key") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"--public-key {path}: not an Ed25519 key")
        return public_hex(key)
    text = raw.decode("ascii", "replace").lower()
    try:
        if len(bytes.fromhex(text)) == 32:
            return text
    except ValueError:
        pass
    raise ValueError(f"--public-key {path}: expected a PEM Ed25519 public key or 64 hex digits")


INCOMPLETE = 3  # exit status: the lines verify, but the set is not whole


def cmd_verify(args: argparse.Namespace) -> int:
    from sandgate.audit.anchor import anchor_path, read_anchor
    from sandgate.audit.verify import Broken, Incomplete, verify

    for f in args.files:
        if not f.is_file():
            return _err(f"audit verify: {f}: no such file")
    if args.anchor is not None and args.confdir is not None:
        return _err("audit verify: give --anchor FILE or --confdir DIR, not both")
    where = args.anchor
    if args.confdir is not None:
        where = anchor_path(args.confdir.expanduser(), args.files[-1])
        if not where.is_file():
            return _err(f"audit verify: {args.confdir} holds no anchor for {args.files[-1]} "
                        f"({where.name}): give the confdir of the proxy that wrote it, or "
                        "--anchor FILE")
    for h in args.after:
        if len(h) != 64 or h.strip("0123456789abcdef"):
            return _err(f"audit verify: --after {h}: expected a line's SHA-256 (64 lower-case "
                        "hex digits, as the report names it)")
    try:
        public = read_public_key(args.public_key) if args.public_key is not None else None
        anchor = read_anchor(where, public) if where is not None else None
    except (OSError, ValueError) as e:
        return _err(str(e))
    try:
        report = verify(list(args.files), public, live=args.live, after=args.after,
                        anchor=anchor)
    except Incomplete as e:
        print(f"INCOMPLETE: {e.file}:{e.line}: {e.what}")
        return INCOMPLETE
    except Broken as e:
        print(f"FAILED: {e.file}:{e.line}: {e.what}")
        return 1
    except OSError as e:
        return _err(f"audit verify: {e}")
    print(report.summary())
    if public is None and report.keys:
        print("note: the signing key was not pinned: give --public-key to check whose "
              "key it is", file=sys.stderr)
    if anchor is None:
        print("note: no anchor given: a last run or a chain's end deleted whole would not be "
              "noticed; give --confdir DIR (or --anchor FILE)", file=sys.stderr)
    return 0


def cmd_public_key(args: argparse.Namespace) -> int:
    from sandgate.audit.chain import SIGNING_KEY_FILE, parse_private_key, public_hex

    path = Path(args.confdir).expanduser() / SIGNING_KEY_FILE
    if not path.is_file():
        return _err(f"{path}: no audit signing key yet (`sandgate run` creates it)")
    try:
        key = parse_private_key(path.read_bytes(), str(path))
    except ValueError as e:
        return _err(str(e))
    print(public_hex(key.public_key()))
    return 0
