"""`sandgate run`'s audit options and the audit log they make (format, chain, rotation).

Kept apart from cli/run.py and runner/ so that those only pass one settings object along:
`add_arguments` registers the options, `from_args` checks them, `open_log` builds the log in
the process that writes it (one process, or each worker of --workers N).
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sandgate.audit.anchor import Anchor
from sandgate.audit.chain import (
    DEFAULT_CHECKPOINT_LINES,
    DEFAULT_CHECKPOINT_SECONDS,
    Chain,
    confdir_signing_key,
    parse_private_key,
)
from sandgate.audit.events import FORMATS, AuditLog
from sandgate.audit.file import Rotation
from sandgate.audit.workerlog import WorkerAuditLog

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sandgate.secrets.vault import VaultConfig


class Worker(Protocol):
    """Which worker of `--workers N` writes (sandgate.workers.control.WorkerRole has it)."""

    @property
    def id(self) -> int: ...

    @property
    def run(self) -> str | None: ...  # the supervisor's run id (the checkpoints name it)

    @property
    def workers(self) -> int | None: ...  # how many workers the run has


@dataclass(frozen=True)
class AuditSettings:
    format: str = "json"
    signing_key: str | None = None  # None: the confdir's key; "vault:MOUNT/PATH#field"; a FILE
    checkpoint_lines: int = DEFAULT_CHECKPOINT_LINES
    checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS
    rotation: Rotation = field(default_factory=Rotation)


def add_arguments(run: argparse.ArgumentParser) -> None:
    g = run.add_argument_group("audit", "the audit stream (docs/audit.md)")
    g.add_argument("--audit-format", choices=FORMATS, default="json",
                   help="json: Sandgate's own fields; ocsf: OCSF 1.8.0 events, Sandgate's "
                   "fields under `unmapped` (default %(default)s)")
    g.add_argument("--audit-signing-key", default=None, metavar="KEY",
                   help="Ed25519 key signing the audit checkpoints: vault:MOUNT/PATH#FIELD "
                   "(KV v2; PEM or a 32-byte seed) or a PEM file (default: "
                   "CONFDIR/audit-signing.key, created on first use)")
    g.add_argument("--audit-checkpoint-lines", type=int, default=DEFAULT_CHECKPOINT_LINES,
                   metavar="N", help="a signed checkpoint after every N lines of a writer "
                   "(default %(default)s)")
    g.add_argument("--audit-checkpoint-seconds", type=float,
                   default=DEFAULT_CHECKPOINT_SECONDS, metavar="SECONDS",
                   help="and within this long after an unsigned line (default %(default)s)")
    g.add_argument("--audit-max-bytes", default=None, metavar="SIZE",
                   help="rotate the --audit file before it grows past SIZE (e.g. 100m)")
    g.add_argument("--audit-max-age", default=None, metavar="TTL",
                   help="rotate the --audit file once it is this old (e.g. 1h, 1d)")
    g.add_argument("--audit-keep", type=int, default=None, metavar="N",
                   help="keep the N newest rotated files, delete older ones (default: all)")


def from_args(args: argparse.Namespace) -> AuditSettings:
    """The settings, checked (ValueError says what is wrong)."""
    from mitmproxy.utils import human

    from sandgate.tokens import parse_ttl

    max_bytes = None
    if args.audit_max_bytes is not None:
        try:
            max_bytes = human.parse_size(args.audit_max_bytes)
        except ValueError:
            max_bytes = None
        if not max_bytes or max_bytes < 1024:
            raise ValueError(f"--audit-max-bytes {args.audit_max_bytes!r}: expected a size of "
                             "at least 1k, like 512k, 100m or 1g")
    max_age = float(parse_ttl(args.audit_max_age)) if args.audit_max_age is not None else None
    if args.audit_keep is not None and args.audit_keep < 1:
        raise ValueError("--audit-keep must be at least 1")
    rotation = Rotation(max_bytes, max_age, args.audit_keep)
    if (rotation.on or rotation.keep is not None) and args.audit is None:
        raise ValueError("--audit-max-bytes, --audit-max-age and --audit-keep rotate the "
                         "--audit FILE: give --audit FILE")
    if args.audit_keep is not None and not rotation.on:
        raise ValueError("--audit-keep keeps rotated files: give --audit-max-bytes or "
                         "--audit-max-age too")
    if args.audit_checkpoint_lines < 1:
        raise ValueError("--audit-checkpoint-lines must be at least 1")
    if args.audit_checkpoint_seconds <= 0:
        raise ValueError("--audit-checkpoint-seconds must be positive")
    spec = args.audit_signing_key
    if spec is not None and not spec.startswith("vault:") and not Path(spec).is_file():
        raise ValueError(f"--audit-signing-key {spec}: no such file (or give "
                         "vault:MOUNT/PATH#FIELD)")
    if spec is not None and spec.startswith("vault:"):
        parse_vault_spec(spec)
    return AuditSettings(args.audit_format, spec, args.audit_checkpoint_lines,
                         args.audit_checkpoint_seconds, rotation)


def parse_vault_spec(spec: str) -> tuple[str, str, str]:
    """vault:MOUNT/PATH#FIELD -> (mount, path, field)."""
    rest = spec.removeprefix("vault:")
    where, sep, fld = rest.partition("#")
    mount, slash, path = where.strip("/").partition("/")
    if not sep or not fld or not slash or not mount or not path:
        raise ValueError(f"--audit-signing-key {spec}: expected vault:MOUNT/PATH#FIELD, e.g. "
                         "vault:secret/sandgate/audit#signing_key")
    return mount, path, fld


def read_vault_key(spec: str, vault: VaultConfig) -> Ed25519PrivateKey:
    """The signing key from a KV v2 secret (AppRole login when configured). Never logs it."""
    import hvac
    import requests

    mount, path, fld = parse_vault_spec(spec)
    session = requests.Session()
    session.trust_env = False  # Vault traffic goes direct, as the broker's does
    client = hvac.Client(url=vault.addr, token=vault.token or "", verify=vault.cacert or True,
                         timeout=vault.timeout, namespace=vault.namespace, session=session)
    try:
        if vault.approle:
            auth = client.auth.approle.login(role_id=vault.role_id, secret_id=vault.secret_id,
                                             use_token=True)
            if not (auth or {}).get("auth"):
                raise ValueError("AppRole login returned no token")
        resp = client.secrets.kv.v2.read_secret_version(path=path, mount_point=mount,
                                                         raise_on_deleted_version=True)
    except Exception as e:  # hvac's errors, connection errors: say which, never a value
        raise ValueError(f"--audit-signing-key {spec}: cannot read it from Vault at "
                         f"{vault.addr} ({type(e).__name__})") from None
    finally:
        session.close()
    data = ((resp or {}).get("data") or {}).get("data") or {}
    value = data.get(fld)
    if not isinstance(value, str) or not value:
        raise ValueError(f"--audit-signing-key {spec}: the secret has no field {fld!r}")
    return parse_private_key(value.encode(), f"--audit-signing-key {spec}")


def signing_key(settings: AuditSettings, confdir: Path,
                vault: VaultConfig | None) -> Ed25519PrivateKey:
    spec = settings.signing_key
    if spec is None:
        return confdir_signing_key(confdir)
    if spec.startswith("vault:"):
        if vault is None:
            raise ValueError(f"--audit-signing-key {spec}: no Vault configured")
        return read_vault_key(spec, vault)
    return parse_private_key(Path(spec).read_bytes(), spec)


def open_log(settings: AuditSettings, audit_file: Path | None, confdir: Path,
             vault: VaultConfig | None, instance: str | None,
             worker: Worker | None = None) -> AuditLog:
    """The audit log of this process: chained, its checkpoints signed (each naming the run, and
    with --workers how many workers it has) and anchored in the confdir, in the format asked."""
    key = signing_key(settings, confdir, vault)
    chain = Chain(key, settings.checkpoint_lines, settings.checkpoint_seconds,
                  run=worker.run if worker is not None else secrets.token_hex(8),
                  workers=worker.workers if worker is not None else None)
    anchor = Anchor(confdir, audit_file, key) if audit_file is not None else None
    if worker is None:
        return AuditLog(audit_file, instance=instance, format=settings.format, chain=chain,
                        rotation=settings.rotation, anchor=anchor)
    return WorkerAuditLog(audit_file, worker.id, instance=instance, format=settings.format,
                          chain=chain, rotation=settings.rotation, anchor=anchor)
