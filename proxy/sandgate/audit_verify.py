"""`sandgate audit verify`: check audit files against their hash chains and signed checkpoints.

Pure: `verify(files)` reads the files in the order given (oldest first: rotated files, then the
current one) and returns a Report: OK with counts, or the first problem with its file and line
number. What is checked, line by line:

- every line is complete (ends in a newline), is a JSON object, and is byte for byte its own
  canonical rendering (so no byte can change without changing what the line says);
- it carries the chain fields; within its writer's chain, `seq` is the next number (a gap:
  lines deleted; a smaller one: lines reordered or repeated) and `prev` is the hash of that
  writer's previous line (else that line was edited, or lines were moved);
- a chain's first line (`seq` 0) links to GENESIS or to a line earlier in the files;
- a checkpoint's Ed25519 signature is valid, by the key given with --public-key if one is;
- every file after the first begins with the `rotate` line naming the file before it and the
  hash of that file's last line (a swapped, missing or truncated file is caught there);
- at the end, every chain ends with its closing checkpoint (`final`): anything after a chain's
  last checkpoint is unsigned, so a file cut at a line boundary is caught. `live=True` accepts
  open chains (the proxy still writing them); a rotated file cut short is still caught by the
  `rotate` line of the file after it.

A first file that begins with a `rotate` line begins after a file not given: the report says
which, and whether a `retention` line records that file's deletion with the same last hash.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandgate.audit_chain import (
    CHAIN,
    CHECKPOINT,
    FINAL,
    GENESIS,
    KEY,
    PREV,
    SEQ,
    SIG,
    fingerprint,
    line_hash,
    render,
    signed_bytes,
    slot,
    verify_signature,
)


class Broken(Exception):
    """The first problem found: where and what."""

    def __init__(self, file: str, line: int, what: str) -> None:
        super().__init__(f"{file}:{line}: {what}")
        self.file, self.line, self.what = file, line, what


@dataclass
class _Chain:
    prev: str
    next_seq: int
    where: tuple[str, int]  # its last line
    signed_at: tuple[str, int] | None = None
    unsigned: int = 0  # lines after the last checkpoint
    closed: bool = False


@dataclass
class Report:
    files: int = 0
    lines: int = 0
    chains: int = 0
    checkpoints: int = 0
    keys: set[str] = field(default_factory=set)
    begins: str | None = None  # what the first file follows
    open_tails: list[str] = field(default_factory=list)  # live: chains still being written

    def summary(self) -> str:
        keys = ", ".join(sorted(fingerprint(k) for k in self.keys)) or "none"
        out = (f"OK: {self.files} file(s), {self.lines} lines, {self.chains} chain(s), "
               f"{self.checkpoints} signed checkpoint(s) (key {keys})")
        if self.begins:
            out += f"; {self.begins}"
        for t in self.open_tails:
            out += f"; {t}"
        return out


def _event(obj: dict[str, Any]) -> Any:
    if "class_uid" in obj:
        return (obj.get("metadata") or {}).get("event_code")
    return obj.get("event")


def _read_lines(path: Path) -> Iterable[tuple[int, bytes]]:
    data = path.read_bytes()
    lines = data.split(b"\n")
    yield from enumerate(lines[:-1], start=1)
    if lines[-1]:
        yield len(lines), lines[-1] + b"\x00"  # marks an unterminated last line


def verify(files: list[Path], public_key: str | None = None, live: bool = False) -> Report:
    """Raises Broken at the first problem; returns the Report when every check passes."""
    report = Report()
    chains: dict[str, _Chain] = {}
    seen: set[str] = set()  # hashes of every line so far (a chain's first line links to one)
    retained: dict[str, str] = {}  # dropped file -> its last line hash (retention lines)
    first_rotate: tuple[str, str, str, int] | None = None  # (previous_file, hash, file, line)
    last_hash = GENESIS
    prev_name: str | None = None
    for path in files:
        name = str(path)
        report.files += 1
        first = True
        for n, raw in _read_lines(path):
            if raw.endswith(b"\x00"):
                raise Broken(name, n, "the last line is incomplete (no newline): the file was "
                             "truncated or a write was cut short")
            try:
                text = raw.decode("utf-8")
                obj = json.loads(text)
            except (UnicodeDecodeError, ValueError):
                raise Broken(name, n, "not a JSON line (edited or damaged)") from None
            if not isinstance(obj, dict):
                raise Broken(name, n, "not a JSON object (edited)")
            if render(obj) != text:
                raise Broken(name, n, "the line is not in its written form (edited: "
                             "whitespace, escapes or number spelling changed)")
            event = _event(obj)
            place = slot(obj)
            if first:
                first = False
                if event == "rotate":
                    pf, pl = place.get("previous_file"), place.get("previous_last")
                    if prev_name is not None:
                        if pf != Path(prev_name).name:
                            raise Broken(name, n, f"this file follows {pf!r}, but the file "
                                         f"given before it is {prev_name}: files missing or "
                                         "out of order")
                        if pl != last_hash:
                            raise Broken(name, n, f"the last line of {prev_name} is not the "
                                         "one this file links to (that file was truncated, "
                                         "or lines were added to it)")
                    else:
                        first_rotate = (str(pf), str(pl), name, n)
                elif prev_name is not None:
                    raise Broken(name, n, "this file does not begin with a rotate line: it "
                                 f"does not follow {prev_name} (files out of order?)")
            if event == "retention" and isinstance(place.get("dropped_file"), str):
                retained[place["dropped_file"]] = str(place.get("dropped_last"))
            cid, seq, prev = place.get(CHAIN), place.get(SEQ), place.get(PREV)
            if not isinstance(cid, str) or not isinstance(seq, int) or not isinstance(prev, str):
                raise Broken(name, n, "the line has no chain fields (chain, seq, prev): "
                             "inserted, or written without the chain")
            h = line_hash(raw)
            ch = chains.get(cid)
            if ch is None:
                if seq == 0 and prev != GENESIS and prev not in seen and seen:
                    raise Broken(name, n, "the first line of a writer links to a line that "
                                 "is not in the files (lines before it were deleted)")
                if seq != 0 and report.files > 1 and first_rotate is None:
                    raise Broken(name, n, f"chain {cid} starts at seq {seq}, not 0: its "
                                 "earlier lines are missing")
                ch = chains[cid] = _Chain(prev, seq, (name, n))
                report.chains += 1
            elif ch.closed:
                raise Broken(name, n, f"chain {cid} was closed at {ch.where[0]}:{ch.where[1]} "
                             "and has a line after it (added or reordered)")
            else:
                if seq > ch.next_seq:
                    raise Broken(name, n, f"lines missing before this one: chain {cid} goes "
                                 f"from seq {ch.next_seq - 1} ({ch.where[0]}:{ch.where[1]}) "
                                 f"to {seq} (deleted lines)")
                if seq < ch.next_seq:
                    raise Broken(name, n, f"out of order: seq {seq} comes after seq "
                                 f"{ch.next_seq - 1} of chain {cid} (reordered or repeated "
                                 "lines)")
                if prev != ch.prev:
                    raise Broken(ch.where[0], ch.where[1], "edited: this line's hash is not "
                                 f"the one the next line of its chain ({name}:{n}) records "
                                 "(or that line's `prev` was edited)")
            if event == CHECKPOINT:
                key, sig = str(place.get(KEY)), str(place.get(SIG))
                if not _lower_hex(place.get(KEY)) or not _lower_hex(place.get(SIG)):
                    raise Broken(name, n, "a checkpoint without a well-formed key and "
                                 "signature")
                if public_key is not None and key != public_key:
                    raise Broken(name, n, f"checkpoint signed by key {fingerprint(key)}, not "
                                 f"by the key given ({fingerprint(public_key)})")
                if not verify_signature(key, sig, signed_bytes(obj)):
                    raise Broken(name, n, "the checkpoint's signature does not verify "
                                 "(edited)")
                report.checkpoints += 1
                report.keys.add(key)
                ch.signed_at, ch.unsigned = (name, n), 0
                ch.closed = place.get(FINAL) is True
            else:
                ch.unsigned += 1
            ch.prev, ch.next_seq, ch.where = h, seq + 1, (name, n)
            seen.add(h)
            last_hash = h
            report.lines += 1
        prev_name = name
    if first_rotate is not None:
        pf, pl, fname, fline = first_rotate
        if pf in retained:
            if retained[pf] != pl:
                raise Broken(fname, fline, f"{pf} was deleted by retention with a different "
                             "last line than this file links to")
            report.begins = f"begins after {pf} (deleted by retention; last line sha256 {pl})"
        else:
            report.begins = f"begins after {pf} (not given; its last line sha256 {pl})"
    for cid, ch in chains.items():
        if ch.closed:
            continue
        if live:  # its next line goes to the current file (rotation links cover the older)
            report.open_tails.append(f"chain {cid} open ({ch.unsigned} line(s) after its last "
                                     "checkpoint)")
            continue
        after = f"after its last checkpoint at {ch.signed_at[0]}:{ch.signed_at[1]}" \
            if ch.signed_at else "and no checkpoint"
        raise Broken(ch.where[0], ch.where[1], f"chain {cid} ends here without its closing "
                     f"checkpoint ({ch.unsigned} unsigned line(s) {after}): the file was "
                     "truncated, or its writer is still running (--live) or crashed")
    return report


def _lower_hex(s: object) -> bool:
    """Hex in the one spelling the writer uses (bytes.fromhex also takes upper case)."""
    if not isinstance(s, str):
        return False
    try:
        return bytes.fromhex(s).hex() == s
    except ValueError:
        return False
