"""Tamper evidence for the audit stream: a hash chain with signed checkpoints.

Every line a writer (one process: `sandgate run`, or one worker of `--workers N`) emits carries
three chain fields: `chain` (the writer's id, random per process), `seq` (0, 1, 2, ... for that
writer, continued across file rotations) and `prev` (the SHA-256, hex, of the bytes of that
writer's previous line, without its newline). The first line of a chain links to the last line
the file held when the writer opened it, or to GENESIS (64 zeros) for an empty file or stdout.
Every `checkpoint_lines` lines, every `checkpoint_seconds` of a quiet tail and when the log is
closed (`final`), the writer adds a `checkpoint` line: itself a chain member, signed with
Ed25519 over its own canonical bytes without `sig` (so over `seq`, `prev`, the signing key and
the time), the public key written in the line for a verifier to check (and pin with
`sandgate audit verify --public-key`).

Completeness: every checkpoint also names its `run` (one `sandgate run`: with --workers N, the
supervisor's run id shared by every worker) and, with workers, `workers` (N), so that a verifier
knows which writers a run had and notices a worker's share deleted whole. Each checkpoint of a
file sink also updates the confdir's signed anchor (`Anchor`: the head, seq and closing state
of every chain of the latest run), which lies outside the audit file: a run deleted whole from
the end of the file, or a chain cut back, falls short of it (`audit verify --anchor`).

With --audit-format ocsf the chain fields live under `unmapped` (`metadata.sequence` repeats
`seq`). A line is rendered as `json.dumps(obj, default=str)` (ASCII, the separators the JSON
format always had); the verifier re-renders every parsed line and requires the same bytes, so
no byte of a line can change without notice (sandgate.audit.verify).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

GENESIS = "0" * 64
CHAIN = "chain"
SEQ = "seq"
PREV = "prev"
KEY = "key"  # checkpoint: the Ed25519 public key, raw 32 bytes hex
SIG = "sig"  # checkpoint: the signature, 64 bytes hex (lower case: one spelling only)
FINAL = "final"  # checkpoint written when the log closes: the chain ends here
LINES = "lines"  # checkpoint: lines of this chain so far (the checkpoint included)
CHECKPOINT = "checkpoint"
RUN = "run"  # checkpoint: the run (one `sandgate run`, all its workers) the chain belongs to
WORKERS = "workers"  # checkpoint: how many workers the run has (--workers N; absent: one)
WORKER = "worker"  # the worker that wrote a line (sandgate.audit.workerlog)
SIGNING_KEY_FILE = "audit-signing.key"
ANCHOR_PREFIX = "audit-anchor."  # CONFDIR/audit-anchor.<hash of the audit file's path>.json

DEFAULT_CHECKPOINT_LINES = 1000
DEFAULT_CHECKPOINT_SECONDS = 60.0


_ENCODER = json.JSONEncoder(default=str)  # json.dumps(obj, default=str) built one per call


def render(obj: MutableMapping[str, Any]) -> str:
    """The one rendering of an audit line (what structlog's JSONRenderer wrote before)."""
    return _ENCODER.encode(obj)


def line_hash(line: str | bytes) -> str:
    """SHA-256 hex of a line's bytes, without its newline."""
    data = line.encode("utf-8") if isinstance(line, str) else line
    return hashlib.sha256(data.rstrip(b"\n")).hexdigest()


def slot(obj: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Where the chain fields of a line live: the line itself, or `unmapped` of an OCSF event."""
    if "class_uid" in obj:
        unmapped = obj.get("unmapped")
        return unmapped if isinstance(unmapped, dict) else {}
    return obj


def signed_bytes(obj: MutableMapping[str, Any]) -> bytes:
    """What a checkpoint's signature covers: its canonical line without the `sig` field."""
    copy = json.loads(render(obj))
    slot(copy).pop(SIG, None)
    return render(copy).encode("utf-8")


def public_hex(key: Ed25519PublicKey) -> str:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def fingerprint(public_key_hex: str) -> str:
    """A short name for a public key in reports: SHA-256 of its raw bytes, first 16 hex."""
    return hashlib.sha256(bytes.fromhex(public_key_hex)).hexdigest()[:16]


def verify_signature(public_key_hex: str, sig_hex: str, data: bytes) -> bool:
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))
        key.verify(bytes.fromhex(sig_hex), data)
    except (ValueError, InvalidSignature):
        return False
    return True


# ------------------------------------------------------------------------------ signing keys

def parse_private_key(raw: bytes, where: str) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM (PKCS#8) or the raw 32-byte seed (raw, hex or base64)."""
    import base64
    import binascii

    text = raw.strip()
    if text.startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(text, password=None)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: not a readable PEM private key ({type(e).__name__})") \
                from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{where}: the audit signing key must be Ed25519, "
                             f"not {type(key).__name__}")
        return key
    seed = raw if len(raw) == 32 else b""
    if not seed:
        with contextlib.suppress(ValueError):
            seed = bytes.fromhex(text.decode("ascii", "replace"))
    if len(seed) != 32:
        try:
            seed = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            seed = b""
    if len(seed) != 32:
        raise ValueError(f"{where}: expected an Ed25519 private key: PEM (PKCS#8) or a 32-byte "
                         "seed (raw, hex or base64)")
    return Ed25519PrivateKey.from_private_bytes(seed)


def confdir_signing_key(confdir: Path) -> Ed25519PrivateKey:
    """The confdir's audit signing key, created (Ed25519, PEM, mode 0600) on first use.

    Created under a temporary name and linked into place, so that workers starting together
    agree on one key (the first link wins, the others read it)."""
    path = Path(confdir) / SIGNING_KEY_FILE
    if not path.exists():
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())
        fd, tmp_name = tempfile.mkstemp(prefix=".sandgate-audit-key.", dir=path.parent)
        tmp = Path(tmp_name)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return parse_private_key(path.read_bytes(), str(path))


# ---------------------------------------------------------------------------------- chain

@dataclass
class Chain:
    """One writer's chain: seals each line it is given, and says when a checkpoint is due."""

    key: Ed25519PrivateKey | None = None  # None: no checkpoints (the chain alone)
    checkpoint_lines: int = DEFAULT_CHECKPOINT_LINES
    checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    prev: str = GENESIS
    seq: int = 0
    unsigned: int = 0  # lines since the last checkpoint
    clock: Callable[[], float] = time.monotonic
    last_checkpoint: float = field(default=0.0)
    run: str | None = None  # the run this writer belongs to (named in every checkpoint)
    workers: int | None = None  # --workers N: how many chains the run has at once

    def __post_init__(self) -> None:
        self.last_checkpoint = self.clock()
        self.public = public_hex(self.key.public_key()) if self.key is not None else None

    def seal(self, obj: MutableMapping[str, Any]) -> str:
        """Add the chain fields to `obj` and return its line (without newline). The chain
        advances only by `commit` once the line is written: a failed write leaves it as it was.
        """
        place = slot(obj)
        if "class_uid" in obj and isinstance(obj.get("metadata"), dict):
            obj["metadata"]["sequence"] = self.seq
        place[CHAIN] = self.id
        place[SEQ] = self.seq
        place[PREV] = self.prev
        return render(obj)

    def commit(self, line: str, checkpoint: bool = False) -> None:
        self.prev = line_hash(line)
        self.seq += 1
        if checkpoint:
            self.unsigned = 0
            self.last_checkpoint = self.clock()
        else:
            self.unsigned += 1

    def checkpoint_due(self) -> bool:
        if self.key is None or self.unsigned == 0:
            return False
        return self.unsigned >= self.checkpoint_lines or \
            self.clock() - self.last_checkpoint >= self.checkpoint_seconds

    def sign(self, obj: MutableMapping[str, Any], final: bool = False) -> str:
        """Seal a checkpoint event `obj` and sign it; returns its line."""
        assert self.key is not None and self.public is not None
        place = slot(obj)
        place[LINES] = self.seq + 1
        place[KEY] = self.public
        if self.run is not None:
            place[RUN] = self.run
        if self.workers is not None:
            place[WORKERS] = self.workers
        if final:
            place[FINAL] = True
        self.seal(obj)
        place[SIG] = self.key.sign(signed_bytes(obj)).hex()
        return render(obj)


def last_line_hash(path: Path) -> str:
    """The hash of the last complete line of `path` (GENESIS when it has none): where a new
    writer's chain starts, so that a run deleted whole from the middle of a file is noticed."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return GENESIS  # /dev/full, a FIFO: nothing to link to (and nothing to read)
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - (1 << 20))
            f.seek(start)
            tail = f.read(size - start)
    except FileNotFoundError:
        return GENESIS
    if not tail.endswith(b"\n"):
        tail = tail[: tail.rfind(b"\n") + 1]  # an unfinished line is no link
    lines = tail.rstrip(b"\n").rsplit(b"\n", 1)
    last = lines[-1] if lines and lines[-1] else b""
    return line_hash(last) if last else GENESIS
