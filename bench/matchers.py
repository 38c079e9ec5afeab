"""Micro-benchmark of multi-pattern matchers for scrubbing (why
`sandgate.scrub.literals` is Hyperscan).

    .venv/bin/python bench/matchers.py [--secrets 21] [--chunk 262144]

Matches the real forms (`sandgate.secrets.forms`) of N secrets over 256 KiB chunks of three
kinds of data (one repeated byte, random bytes, English text) and prints MB/s per matcher, plus
`sandgate.scrub.scrubber`'s streaming scrubber end to end. Candidates that are not installed (only
Hyperscan is a dependency) are skipped: `pip install pyahocorasick ahocorasick-rs google-re2`
to compare. Asserts nothing; the figures move with the machine, their ratios much less.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "proxy"))

from sandgate.scrub.literals import LiteralSet
from sandgate.scrub.scrubber import SecretSet
from sandgate.secrets.forms import classified_forms


def matchers(needles: list[bytes]) -> dict[str, Callable[[bytes], object]]:
    out: dict[str, Callable[[bytes], object]] = {}
    lit: LiteralSet[int] = LiteralSet({n: len(n) for n in needles})
    out["hyperscan (sandgate.scrub.literals)"] = lit.ends
    by_len = sorted(needles, key=len, reverse=True)
    alternation = re.compile(b"|".join(re.escape(n) for n in by_len))
    out["re alternation"] = lambda d: [m.span() for m in alternation.finditer(d)]
    try:
        aho = importlib.import_module("ahocorasick")
        auto = aho.Automaton()
        for n in needles:
            auto.add_word(n.decode("latin-1"), len(n))
        auto.make_automaton()
        out["pyahocorasick"] = lambda d: list(auto.iter(d.decode("latin-1")))
    except ImportError:
        pass
    try:
        rs = importlib.import_module("ahocorasick_rs")
        m = rs.BytesAhoCorasick(needles, matchkind=rs.MatchKind.LeftmostLongest)
        out["ahocorasick-rs"] = m.find_matches_as_indexes
    except ImportError:
        pass
    try:
        re2 = importlib.import_module("re2")
        p2 = re2.compile(b"|".join(re.escape(n) for n in by_len))
        out["re2"] = lambda d: [m.span() for m in p2.finditer(d)]
    except ImportError:
        pass
    return out


def rate(fn: Callable[[bytes], object], data: bytes, seconds: float = 0.3) -> float:
    fn(data)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(data)
        n += 1
    return len(data) * n / (time.perf_counter() - t0) / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--secrets", type=int, default=21)
    ap.add_argument("--chunk", type=int, default=256 * 1024)
    args = ap.parse_args()
    values = [b"bench-secret-value-not-a-real-key-5e1f"]
    values += [os.urandom(24).hex().encode() for _ in range(args.secrets - 1)]
    needles = sorted({f for v in values for f in classified_forms(v)})
    n = args.chunk
    data = {"one byte": b"b" * n, "random": os.urandom(n),
            "text": (b"The quick brown fox jumps over the lazy dog 0123456789. " * (n // 50 + 1))
            [:n]}
    secrets = SecretSet({f"s{i}": v for i, v in enumerate(values)})

    def stream(d: bytes) -> object:
        s = secrets.scrubber()
        return s.feed(d), s.flush()

    print(f"{len(needles)} needles ({args.secrets} secrets), {n} byte chunks, MB/s:")
    cands = {**matchers(needles), "SecretSet stream scrub (end to end)": stream}
    print(f"  {'matcher':<38}" + "".join(f"{k:>12}" for k in data))
    for name, fn in cands.items():
        print(f"  {name:<38}" + "".join(f"{rate(fn, d):12.0f}" for d in data.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
