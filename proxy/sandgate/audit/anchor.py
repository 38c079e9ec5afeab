"""The audit anchor: where the audit file must reach, kept outside it, in the confdir.

A hash chain shows lines edited, reordered or cut from inside a chain, and a chain's first
line links to the line before it; but nothing in an audit file can show that whole lines were
cut from its end: the last run deleted whole (it ended with its signed closing checkpoint, the
run before it still does), or a chain cut back to one of its checkpoints. So every signed
checkpoint of a writer to a file also updates `CONFDIR/audit-anchor.<hash of the file's
path>.json`: one signed JSON object naming the latest run and, for each of its chains (one per
worker, and one per restart of a worker), the `seq` and the hash (`head`) of its last
checkpoint and whether that one closed the chain. A new run replaces the previous run's chains
(the new run's first lines link to the file's last line, which covers what came before).

`sandgate audit verify --anchor FILE` (or `--confdir DIR`) then requires every chain the anchor
names to be in the files and to reach that head (sandgate.audit.verify). Workers update the
anchor under an flock on `FILE.lock`, each its own chain's entry; it is replaced by a rename,
so a reader never sees half of one. It costs one small file write per checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sandgate.audit.chain import (
    ANCHOR_PREFIX,
    KEY,
    RUN,
    SIG,
    WORKERS,
    Chain,
    fingerprint,
    public_hex,
    render,
    signed_bytes,
    verify_signature,
)

ANCHOR = "anchor"  # the format's version
FILE = "file"
CHAINS = "chains"  # chain id -> {worker, seq, head, final}
HEAD = "head"


def anchor_path(confdir: Path, audit_file: Path) -> Path:
    """The anchor of `audit_file` in `confdir` (by the file's real path: one per audit file)."""
    real = os.path.realpath(audit_file)
    return Path(confdir) / f"{ANCHOR_PREFIX}{hashlib.sha256(real.encode()).hexdigest()[:16]}.json"


@dataclass(frozen=True)
class AnchoredChain:
    worker: int | None
    seq: int
    head: str
    final: bool


@dataclass(frozen=True)
class AnchorDoc:
    """A read, signature-checked anchor."""

    path: str  # where it was read from
    file: str
    run: str
    workers: int | None
    chains: dict[str, AnchoredChain]
    key: str


class Anchor:
    """The writer's side: `update` after each checkpoint of `chain` is written."""

    def __init__(self, confdir: Path, audit_file: Path, key: Ed25519PrivateKey) -> None:
        self.audit_file = Path(os.path.realpath(audit_file))
        self.path = anchor_path(confdir, audit_file)
        self._key = key
        self._public = public_hex(key.public_key())

    def update(self, chain: Chain, worker: int | None, final: bool) -> None:
        """Record `chain`'s last line (a checkpoint just written) as its head. Raises OSError
        when the anchor cannot be written (the caller fails closed as for the line itself)."""
        lock = os.open(self.path.with_name(self.path.name + ".lock"),
                       os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            doc = _load(self.path)
            if doc is None or doc.get(RUN) != chain.run or not isinstance(doc.get(CHAINS), dict):
                doc = {ANCHOR: 1, FILE: str(self.audit_file), RUN: chain.run,
                       WORKERS: chain.workers, CHAINS: {}}
            doc[CHAINS][chain.id] = {"worker": worker, "seq": chain.seq - 1, HEAD: chain.prev,
                                     "final": final}
            doc["time"] = datetime.now(UTC).isoformat(timespec="milliseconds")
            doc.pop(SIG, None)
            doc[KEY] = self._public
            doc[SIG] = self._key.sign(signed_bytes(doc)).hex()
            fd, tmp = tempfile.mkstemp(prefix=".sandgate-anchor.", dir=self.path.parent)
            try:
                os.fchmod(fd, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(render(doc) + "\n")
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        finally:
            os.close(lock)


def _load(path: Path) -> dict[str, Any] | None:
    """The anchor as it is (a missing or unreadable one is started afresh by the writer)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def read_anchor(path: Path, public_key: str | None) -> AnchorDoc:
    """The anchor at `path`, its signature checked (by `public_key` when given). ValueError
    says what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"--anchor {path}: not an audit anchor (not JSON)") from None
    if not isinstance(doc, dict) or doc.get(ANCHOR) != 1 or not isinstance(doc.get(CHAINS), dict):
        raise ValueError(f"--anchor {path}: not an audit anchor "
                         "(CONFDIR/audit-anchor.*.json)")
    key, sig = doc.get(KEY), doc.get(SIG)
    if not isinstance(key, str) or not isinstance(sig, str) or \
            not verify_signature(key, sig, signed_bytes(doc)):
        raise ValueError(f"--anchor {path}: its signature does not verify (edited)")
    if public_key is not None and key != public_key:
        raise ValueError(f"--anchor {path}: signed by key {fingerprint(key)}, not by the key "
                         f"given ({fingerprint(public_key)})")
    chains: dict[str, AnchoredChain] = {}
    for cid, c in doc[CHAINS].items():
        if not isinstance(c, dict) or not isinstance(c.get("seq"), int) or \
                not isinstance(c.get(HEAD), str):
            raise ValueError(f"--anchor {path}: chain {cid} has no seq and head")
        worker = c.get("worker")
        chains[cid] = AnchoredChain(worker if isinstance(worker, int) else None, c["seq"],
                                    c[HEAD], c.get("final") is True)
    workers = doc.get(WORKERS)
    return AnchorDoc(str(path), str(doc.get(FILE)), str(doc.get(RUN)),
                     workers if isinstance(workers, int) else None, chains, key)
