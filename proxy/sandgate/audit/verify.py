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

Completeness (Incomplete, a Broken of its own: `audit verify` exits 3 for it, 1 for the rest):

- the files must begin where the history begins: a chain whose first line in the files is not
  its `seq` 0, or links to a line not in the files, means an earlier run or a writer's first
  lines were deleted, unless the start is stated: `after` (--after HASH, the hash of the line
  before), or the first file begins with a `rotate` line after a file that a `retention` line
  records as deleted (or whose last hash is given as `after`);
- a run's checkpoints name it and, with --workers N, N: each of the N workers must have a chain
  in the files (a worker's share deleted whole);
- `anchor` (sandgate.audit.anchor, from the confdir): every chain of the latest run it names
  must be in the files and reach the head it names (a last run deleted whole, a chain cut back
  to a checkpoint);
- a chain without its closing checkpoint whose last line a later writer's first line links to
  is a writer that crashed (or was killed): reported, not a failure, since nothing after it can
  be missing; without such a link (and not `live`) it may have been cut short: a failure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandgate.audit.anchor import AnchorDoc
from sandgate.audit.chain import (
    CHAIN,
    CHECKPOINT,
    FINAL,
    GENESIS,
    KEY,
    PREV,
    RUN,
    SEQ,
    SIG,
    WORKER,
    WORKERS,
    fingerprint,
    line_hash,
    render,
    signed_bytes,
    slot,
    verify_signature,
)
from sandgate.errors import NotVerified


class Broken(NotVerified):
    """The first problem found: where and what."""

    def __init__(self, file: str, line: int, what: str) -> None:
        super().__init__(f"{file}:{line}: {what}")
        self.file, self.line, self.what = file, line, what


class Incomplete(Broken):
    """The lines given verify, but the set is not whole: a run, a writer's chain or the end of
    one is missing, or the files begin mid-history without saying where."""


@dataclass
class _Chain:
    prev: str
    next_seq: int
    where: tuple[str, int]  # its last line
    signed_at: tuple[str, int] | None = None
    unsigned: int = 0  # lines after the last checkpoint
    closed: bool = False
    run: str | None = None  # from its checkpoints
    worker: int | None = None  # from its lines (--workers)


@dataclass
class Report:
    files: int = 0
    lines: int = 0
    chains: int = 0
    checkpoints: int = 0
    keys: set[str] = field(default_factory=set)
    begins: str | None = None  # what the first file follows
    open_tails: list[str] = field(default_factory=list)  # live: chains still being written
    runs: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)  # crashes, what the anchor showed

    def summary(self) -> str:
        keys = ", ".join(sorted(fingerprint(k) for k in self.keys)) or "none"
        out = (f"OK: {self.files} file(s), {self.lines} lines, {self.chains} chain(s), "
               f"{self.checkpoints} signed checkpoint(s) (key {keys})")
        if self.runs:
            out += f"; {len(self.runs)} run(s)"
        if self.begins:
            out += f"; {self.begins}"
        for t in [*self.open_tails, *self.notes]:
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


def verify(files: list[Path], public_key: str | None = None, live: bool = False,
           after: Iterable[str] = (), anchor: AnchorDoc | None = None) -> Report:
    """Raises Broken (or Incomplete) at the first problem; returns the Report when every check
    passes. `after`: hashes of lines the files may begin after (--after); `anchor`: the
    confdir's anchor, read and checked (sandgate.audit.anchor.read_anchor)."""
    report = Report()
    chains: dict[str, _Chain] = {}
    seen: set[str] = set()  # hashes of every line so far (a chain's first line links to one)
    retained: dict[str, str] = {}  # dropped file -> its last line hash (retention lines)
    first_rotate: tuple[str, str, str, int] | None = None  # (previous_file, hash, file, line)
    starts: set[str] = set(after)
    stated: set[str] = set()  # the --after hashes the files do begin after
    linked: set[str] = set()  # what the first lines (seq 0) of chains link to
    run_workers: dict[str, tuple[int, str, int]] = {}  # run -> (N, where a checkpoint says so)
    anchored = anchor.chains if anchor is not None else {}
    gap: Incomplete | None = None
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
                if seq == 0:
                    linked.add(prev)
                if seq == 0 and (prev == GENESIS or prev in seen):
                    pass  # the history begins here, or links to a line given
                elif prev in starts:
                    stated.add(prev)  # --after: the files are said to begin there
                elif first_rotate is not None:
                    pass  # after a rotated file not given: checked below (retention, --after)
                elif seq == 0 and seen:
                    # reported after the pass, unless a missing worker explains it better
                    gap = gap or Incomplete(name, n, f"a gap: chain {cid} begins here linking "
                                            "to a line that is not in the files (sha256 "
                                            f"{prev}): the lines before it were deleted (the "
                                            "end of the run before, whole runs, or another "
                                            "worker's share)")
                elif seq != 0 and report.files > 1:
                    raise Broken(name, n, f"chain {cid} starts at seq {seq}, not 0: its "
                                 "earlier lines are missing")
                else:
                    at = f"seq {seq}" + (", not 0" if seq else "")
                    raise Incomplete(name, n, f"the files begin mid-history: chain {cid}'s "
                                     f"first line here ({at}) follows a line that is not in "
                                     f"the files (sha256 {prev}): an earlier run or this "
                                     "writer's first lines were deleted, or the files given "
                                     "begin after one not given. If they legitimately begin "
                                     f"there (an export, a cut), state it: --after {prev}")
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
            if isinstance(place.get(WORKER), int):
                ch.worker = place[WORKER]
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
                run, workers = place.get(RUN), place.get(WORKERS)
                if isinstance(run, str):
                    ch.run = run
                    report.runs.add(run)
                    if isinstance(workers, int) and run not in run_workers:
                        run_workers[run] = (workers, name, n)
            else:
                ch.unsigned += 1
            a = anchored.get(cid)
            if a is not None and a.seq == seq and a.head != h:
                raise Broken(name, n, f"this line is not the one the anchor names as seq {seq} "
                             f"of chain {cid} (sha256 {a.head}): replaced")
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
        elif pl in starts:
            stated.add(pl)
            report.begins = f"begins after {pf} (as stated by --after; its last line sha256 " \
                f"{pl})"
        else:
            raise Incomplete(fname, fline, f"the files begin after {pf}, which is not given and "
                             "which no retention line records as deleted: give it (oldest "
                             "first), or if they legitimately begin there, state it: --after "
                             f"{pl}")
    if stated and report.begins is None:
        report.begins = "begins after " + ", ".join(sorted(stated)) + " (as stated by --after)"
    _check_workers(chains, run_workers, live, report)
    if gap is not None:
        raise gap
    _check_tails(chains, linked, live, report)
    if anchor is not None:
        _check_anchor(anchor, chains, live, report)
    return report


def _who(cid: str, ch: _Chain | None = None, run: str | None = None,
         worker: int | None = None) -> str:
    run = ch.run if ch is not None else run
    worker = ch.worker if ch is not None else worker
    parts = [f"run {run}"] if run else []
    if worker is not None:
        parts.append(f"worker {worker}")
    return f"chain {cid}" + (f" ({', '.join(parts)})" if parts else "")


def _check_tails(chains: dict[str, _Chain], linked: set[str], live: bool,
                 report: Report) -> None:
    """Every chain ends with its closing checkpoint, or its writer crashed and a later one
    links to its last line, or (live) it is still being written."""
    for cid, ch in chains.items():
        if ch.closed:
            continue
        if live:  # its next line goes to the current file (rotation links cover the older)
            report.open_tails.append(f"chain {cid} open ({ch.unsigned} line(s) after its last "
                                     "checkpoint)")
            continue
        if ch.prev in linked:
            report.notes.append(f"{_who(cid, ch)} ended at {ch.where[0]}:{ch.where[1]} "
                                "without its closing checkpoint: its writer crashed or was "
                                "killed (a later writer's first line links to that line, so "
                                "nothing after it is missing)")
            continue
        after = f"after its last checkpoint at {ch.signed_at[0]}:{ch.signed_at[1]}" \
            if ch.signed_at else "and no checkpoint"
        raise Broken(ch.where[0], ch.where[1], f"{_who(cid, ch)} ends here without its closing "
                     f"checkpoint ({ch.unsigned} unsigned line(s) {after}): the file was "
                     "truncated, or its writer is still running (--live), or it crashed or "
                     "was killed and no later writer links to its last line")


def _check_workers(chains: dict[str, _Chain], run_workers: dict[str, tuple[int, str, int]],
                   live: bool, report: Report) -> None:
    """Each of a run's N workers (its checkpoints say N) has a chain in the files."""
    have: dict[str | None, set[int | None]] = {}
    for ch in chains.values():  # one pass: a file of many runs stays linear
        have.setdefault(ch.run, set()).add(ch.worker)
    for run, (n, fname, fline) in run_workers.items():
        missing = [k for k in range(n) if k not in have.get(run, set())]
        if not missing:
            continue
        names = ", ".join(map(str, missing))
        if live:  # a worker that has not signed a line yet is not known to be of the run
            report.notes.append(f"run {run}: no signed line of worker(s) {names} yet")
            continue
        raise Incomplete(fname, fline, f"run {run} had {n} workers (its signed checkpoints say "
                         f"so), but no signed line of worker(s) {names} of this run is in the "
                         "files: that share of the run (or its end) was deleted, or is in a "
                         "file not given")


def _check_anchor(anchor: AnchorDoc, chains: dict[str, _Chain], live: bool,
                  report: Report) -> None:
    """Every chain the anchor names is in the files and reaches the head it names."""
    for cid, a in anchor.chains.items():
        ch = chains.get(cid)
        head = f"seq {a.seq}, sha256 {a.head}" + (", its closing checkpoint" if a.final else "")
        if ch is None:
            if live and report.begins is not None:  # idle since before the first file given
                report.notes.append(f"{_who(cid, None, anchor.run, a.worker)}: no line in the "
                                    f"files given (the anchor names it at seq {a.seq})")
                continue
            raise Incomplete(anchor.path, 1, f"{_who(cid, None, anchor.run, a.worker)}, which "
                             f"the anchor names with its head at {head}, has no line in the "
                             "files: that run (or that worker's share of it) was deleted, or "
                             "is in a file not given")
        if ch.next_seq - 1 < a.seq:
            raise Incomplete(ch.where[0], ch.where[1], f"{_who(cid, ch)} ends here at seq "
                             f"{ch.next_seq - 1}, short of the head the anchor names ({head}): "
                             "the lines after were deleted")
    report.notes.append(f"the anchor's {len(anchor.chains)} chain(s) of run {anchor.run} reach "
                        "their anchored heads")


def _lower_hex(s: object) -> bool:
    """Hex in the one spelling the writer uses (bytes.fromhex also takes upper case)."""
    if not isinstance(s, str):
        return False
    try:
        return bytes.fromhex(s).hex() == s
    except ValueError:
        return False
