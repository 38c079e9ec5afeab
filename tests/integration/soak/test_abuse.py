"""Slow, idle and oversized clients: others keep being served, and memory comes back."""

from __future__ import annotations

import asyncio
import base64
import ssl
import statistics
import time
from dataclasses import dataclass, field

import pytest

from tests.integration.soak.conftest import (
    IDENTITIES,
    LISTEN,
    SoakProxy,
    finish,
    start_soak_proxy,
)
from tests.integration.soak.mix import check, client_ssl, make_case, make_mix, run_all, run_worker
from tests.support.loadclient import Res, read_response

pytestmark = pytest.mark.soak

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class Abuse:
    """One round of abusive clients, scaled: what they got is kept for the checks."""

    idle: int
    slow: int
    oversized: int
    slow_seconds: float
    held: list[Stream] = field(default_factory=list)
    half_heads: list[Stream] = field(default_factory=list)  # idle with half a request head
    outcomes: dict[str, list[int | str]] = field(default_factory=dict)
    slow_cut_after: list[float] = field(default_factory=list)  # seconds until the proxy answered

    def note(self, kind: str, outcome: int | str) -> None:
        self.outcomes.setdefault(kind, []).append(outcome)


def _auth(identity: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{identity}:{token}".encode()).decode()


async def _tunnel(sp: SoakProxy, identity: str, host: str, ctx: ssl.SSLContext) -> Stream:
    r, w = await asyncio.wait_for(asyncio.open_connection(LISTEN, sp.proxy.port), 30)
    w.write(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: "
            f"{_auth(identity, sp.tokens[identity])}\r\n\r\n".encode())
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
    assert head.startswith(b"HTTP/1.1 200"), head[:100]
    await asyncio.wait_for(w.start_tls(ctx, server_hostname=host), 30)
    return r, w


async def _idle(sp: SoakProxy, a: Abuse, n: int, ctx: ssl.SSLContext,
                gate: asyncio.Semaphore) -> None:
    """Connections that open and then say nothing: a third bare TCP, a third inside a TLS
    tunnel (spread over the identities), a third stopped half way through a request head."""
    async with gate:
        try:
            if n % 3 == 0:
                r, w = await asyncio.wait_for(asyncio.open_connection(LISTEN, sp.proxy.port), 30)
            elif n % 3 == 1:
                r, w = await _tunnel(sp, IDENTITIES[n % 4], "open.soak.test", ctx)
            else:
                r, w = await asyncio.wait_for(asyncio.open_connection(LISTEN, sp.proxy.port), 30)
                w.write(b"GET http://open.soak.test/pub/idle HTTP/1.1\r\nHost: open.soa")
                await w.drain()
                a.half_heads.append((r, w))
            a.held.append((r, w))
            a.note("idle", "open")
        except (OSError, TimeoutError, AssertionError) as e:
            a.note("idle", type(e).__name__)


async def _slow(sp: SoakProxy, a: Abuse, n: int) -> None:
    """A request head sent a byte a second until the proxy answers (or the client gives up
    after `slow_seconds`)."""
    ident = IDENTITIES[n % 4]
    head = (f"GET http://open.soak.test/pub/slow-{n} HTTP/1.1\r\nHost: open.soak.test\r\n"
            f"X-Soak-Id: slow-{n}\r\nProxy-Authorization: {_auth(ident, sp.tokens[ident])}"
            "\r\n\r\n").encode()
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(LISTEN, sp.proxy.port), 30)
    except (OSError, TimeoutError) as e:
        a.note("slow", type(e).__name__)
        return
    started = time.monotonic()
    answer = asyncio.create_task(read_response(r, "GET"))
    try:
        for i in range(len(head)):
            if answer.done() or time.monotonic() - started > a.slow_seconds:
                break
            w.write(head[i:i + 1])
            await w.drain()
            await asyncio.wait({answer}, timeout=1)
    except OSError:
        pass
    finally:
        a.note("slow", await _outcome(answer, 0))
        a.slow_cut_after.append(time.monotonic() - started)
        w.transport.abort()


async def _outcome(answer: asyncio.Task[tuple[int, str, bytes, bytes, bool]],
                   wait: float) -> str:
    """What a client got: "STATUS CODE", "closed (...)", or "gave up" (no answer in `wait`)."""
    try:
        status, code, *_ = await asyncio.wait_for(asyncio.shield(answer), wait) if wait else \
            answer.result()
        return f"{status} {code}".strip()
    except (OSError, asyncio.IncompleteReadError, ssl.SSLError) as e:
        return f"closed ({type(e).__name__})"
    except (TimeoutError, asyncio.InvalidStateError):
        answer.cancel()
        return "gave up"


async def _oversized(sp: SoakProxy, a: Abuse, n: int, ctx: ssl.SSLContext) -> None:
    """Inside a tunnel: a 1 MiB head, an 8 MiB declared-and-sent body, a 2 MiB chunked body."""
    ident = IDENTITIES[n % 4]
    kind = ("header", "body", "chunked")[n % 3]
    rid = f"big-{kind}-{n}"
    try:
        r, w = await _tunnel(sp, ident, "api.soak.test", ctx)
    except (OSError, TimeoutError, AssertionError) as e:
        a.note(kind, type(e).__name__)
        return
    try:
        base = f"POST /v1/big/{rid} HTTP/1.1\r\nHost: api.soak.test\r\nX-Soak-Id: {rid}\r\n"
        if kind == "header":
            # sent in pieces while the answer is read: the proxy answers at the limit (64 KiB)
            # and closes; the rest of the head would only meet a reset
            pad = "".join(f"X-Pad-{i}: {'p' * 16000}\r\n" for i in range(64))
            data = (base + pad + "Content-Length: 2\r\n\r\n{}").encode()
            answer = asyncio.create_task(read_response(r, "POST"))
            try:
                for off in range(0, len(data), 16384):
                    if answer.done():
                        break
                    w.write(data[off:off + 16384])
                    await w.drain()
            except (OSError, ssl.SSLError):
                pass
            a.note(kind, await _outcome(answer, 30))
            return
        if kind == "body":
            w.write((base + f"Content-Length: {8 << 20}\r\n\r\n").encode())
            for _ in range(8):
                w.write(b"b" * (1 << 20))
                await w.drain()
        else:
            w.write((base + "Transfer-Encoding: chunked\r\n\r\n").encode())
            for _ in range(32):
                w.write(b"10000\r\n" + b"c" * 0x10000 + b"\r\n")
                await w.drain()
            w.write(b"0\r\n\r\n")
        await w.drain()
        status, code, *_ = await asyncio.wait_for(read_response(r, "POST"), 30)
        a.note(kind, f"{status} {code}".strip())
    except (OSError, asyncio.IncompleteReadError, ssl.SSLError) as e:
        a.note(kind, f"closed ({type(e).__name__})")
    except TimeoutError:
        a.note(kind, "no answer in 30 s")
    finally:
        w.transport.abort()


async def _abuse(sp: SoakProxy, a: Abuse, hold: float, probe: list[Res]) -> tuple[int, float]:
    """Run one round while a probe client keeps calling: open the idle connections, then start
    the slow and oversized clients and hold everything for `hold` seconds.

    Returns the peak RSS (KiB) and when the idle connections were all open (monotonic)."""
    ctx = client_ssl(str(sp.proxy.ca))
    gate = asyncio.Semaphore(64)
    stop = asyncio.Event()
    peak = sp.rss_kib()
    # one keep-alive client calling back to back (its tunnel is opened before the round)
    cases = [make_case("inject", IDENTITIES[0], f"probe-{a.idle}-{n}") for n in range(5000)]
    prober = asyncio.create_task(run_worker(sp.proxy.port, sp.tokens, ctx, cases,
                                            lambda _, r: probe.append(r), stop))
    while not probe:
        if prober.done():  # the probe failed before its first answer: say why, never wait on
            await prober
            raise AssertionError("the probe client ended before its first answer")
        await asyncio.sleep(0.05)
    await asyncio.gather(*(_idle(sp, a, n, ctx, gate) for n in range(a.idle)))
    held_from = time.monotonic()
    tasks = {asyncio.create_task(_slow(sp, a, n)): f"slow-{n}" for n in range(a.slow)}
    tasks |= {asyncio.create_task(_oversized(sp, a, n, ctx)): f"oversized-{n}"
              for n in range(a.oversized)}
    # every client bounds its own waits (30 s); this deadline is the round's own, so a client
    # stuck where no bound reaches (a drain the proxy never frees) fails the round, named,
    # instead of hanging the lane
    ends = time.monotonic() + hold
    gives_up = ends + max(a.slow_seconds, 30) + 30
    while time.monotonic() < ends or not all(t.done() for t in tasks):
        if time.monotonic() > gives_up:
            for t, name in tasks.items():
                if not t.done():
                    t.cancel()
                    a.note("stuck", name)
            await asyncio.gather(*tasks, return_exceptions=True)
            break
        peak = max(peak, sp.rss_kib())
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.wait_for(prober, 60)
    # the half heads: each answered 408 and closed once --header-timeout passed
    outcomes = await asyncio.gather(*(_outcome(asyncio.create_task(read_response(r, "GET")), 6)
                                      for r, _ in a.half_heads))
    for o in outcomes:
        a.note("half-head", o)
    for _, w in a.held:
        w.transport.abort()
    return peak, held_from


def _settle(sp: SoakProxy, fds: int, seconds: float = 20) -> None:
    """Wait until the proxy has closed what the clients closed."""
    deadline = time.monotonic() + seconds
    while sp.fds() > fds + 16 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)


def test_slow_idle_and_oversized_clients(tmp_path, soak_vault, soak_pki, recorder,
                                         plain_recorder):
    """Bounds: a warm-up (800 mixed requests, then one full round, held 1 s), then the round
    that counts: 2,000 idle connections (bare, in a TLS tunnel, half a request head), 20 slow
    clients (a header byte a second, giving up after 12 s), 30 oversized requests (1 MiB
    heads, 8 MiB and 2 MiB chunked bodies over --max-request-body 1m), held for 15 s; a probe
    client calls throughout; --header-timeout 4. About 60 s.

    The probe's every request is answered right, its median latency while the round is held
    within 5x (+0.5 s) of the quiet baseline. Every slow client, and every idle connection
    holding half a head, is cut off with 408 header_timeout (after --header-timeout, before
    the client would give up); every 1 MiB head gets 431 headers_too_large, and none of them
    (nor any oversized body) reaches the upstream; after
    the round the proxy's descriptors come back, and its RSS returns to within 20% of the
    baseline taken after the warm-up. The warm-up ran the same round once, because the heap
    keeps its high-water mark (the first round takes RSS from ~110 to ~190 MiB and it stays
    there while gc-tracked object counts and descriptors return): against a fresher baseline
    the check would measure the allocator; against this one, state kept per connection (a
    round holds ~70 MiB of it) shows.
    """
    header_timeout = 4
    # The round holds 2,000 unidentified connections from one source on purpose, to measure
    # what each one keeps: the admission bounds that would close them early (per-source cap,
    # first-byte and identify deadlines) are off here and tested on their own in
    # tests/integration/test_wire_starvation.py.
    sp = start_soak_proxy(tmp_path, soak_vault, soak_pki, "--max-request-body", "1m",
                          "--header-timeout", str(header_timeout),
                          "--max-unidentified-per-source", "0", "--first-byte-timeout", "0",
                          "--identify-timeout", "0")
    try:
        # warm-up: every path once, at small scale
        asyncio.run(run_all(sp.proxy.port, sp.tokens, str(sp.proxy.ca),
                            make_mix("abuse-warm", workers=20, per_worker=40)))
        rss_fresh = sp.rss_kib()
        # ... and one full round: what it leaves behind is the allocator's high-water mark
        # (the heap keeps it; gc-tracked objects and descriptors do come back), so the
        # baseline is taken after it and the round that counts shows what each round keeps.
        warm_probe: list[Res] = []
        fds0 = sp.fds()
        warm = Abuse(idle=2000, slow=20, oversized=30, slow_seconds=4)
        warm_peak, _ = asyncio.run(_abuse(sp, warm, 1, warm_probe))
        assert not warm.outcomes.get("stuck"), f"warm-up clients stuck: {warm.outcomes['stuck']}"
        _settle(sp, fds0)

        quiet: list[Res] = []

        async def baseline() -> None:
            ctx = client_ssl(str(sp.proxy.ca))
            cases = [make_case("inject", IDENTITIES[0], f"quiet-{n}") for n in range(40)]
            quiet.extend(r for _, r in await run_worker(sp.proxy.port, sp.tokens, ctx, cases))

        asyncio.run(baseline())
        rss0, fds0 = sp.rss_kib(), sp.fds()

        a = Abuse(idle=2000, slow=20, oversized=30, slow_seconds=12)
        probe: list[Res] = []
        t0 = time.monotonic()
        peak, held_from = asyncio.run(_abuse(sp, a, 15, probe))
        took = time.monotonic() - t0
        _settle(sp, fds0)
        rss1, fds1 = sp.rss_kib(), sp.fds()

        q50 = statistics.median(r.latency for r in quiet)
        # while the 2,000 are held and the slow and oversized clients run (opening 2,000
        # connections is load like any other, not a test of latency)
        held = [r for r in probe if r.started >= held_from]
        p50 = statistics.median(r.latency for r in held)
        print(f"\nabuse: {took:.0f} s; outcomes "
              f"{ {k: sorted(set(map(str, v))) for k, v in a.outcomes.items()} }; "
              f"idle open {a.outcomes['idle'].count('open')}; slow clients cut after "
              f"{min(a.slow_cut_after):.1f}-{max(a.slow_cut_after):.1f} s; "
              f"probe {len(probe)} requests, "
              f"{len(held)} while held: p50 {p50 * 1000:.0f} ms (quiet {q50 * 1000:.0f} ms), "
              f"max {max(r.latency for r in held) * 1000:.0f} ms; "
              f"RSS fresh {rss_fresh // 1024} MiB, "
              f"warm-up round peak {warm_peak // 1024} MiB, baseline {rss0 // 1024} MiB, "
              f"peak {peak // 1024} MiB, after {rss1 // 1024} MiB; fds {fds0} -> {fds1}")

        assert not a.outcomes.get("stuck"), f"clients stuck past the round: {a.outcomes['stuck']}"
        assert a.outcomes["idle"].count("open") == 2000, "the proxy refused idle connections"
        problems = check([(make_case("inject", IDENTITIES[0], r.rid), r) for r in probe],
                         {"https": recorder, "http": plain_recorder})
        assert not problems, "the probe was hurt:\n" + "\n".join(problems[:20])
        assert len(held) >= 10
        assert p50 <= 5 * q50 + 0.5, f"probe median {p50:.2f} s vs quiet {q50:.2f} s"
        # bodies over the limit: 413 or a cut connection, never forwarded
        assert not [k for k in recorder.seen if k.startswith(("big-body", "big-chunked"))]
        for kind in ("body", "chunked"):
            bad = [o for o in a.outcomes[kind] if not str(o).startswith(("413", "closed"))]
            assert not bad, f"oversized {kind}: {bad}"
        # 1 MiB heads: 431 at the head limit, never forwarded
        assert not [k for k in recorder.seen if k.startswith("big-header")]
        bad = [o for o in a.outcomes["header"] if o != "431 headers_too_large"]
        assert not bad, f"oversized header: {bad}"
        # a head trickling in (a byte a second, or stopped half way): 408 at --header-timeout,
        # well before the slow client gives up (12 s); never forwarded
        bad = [o for o in a.outcomes["slow"] if o != "408 header_timeout"]
        assert not bad, f"slow clients: {bad}"
        assert min(a.slow_cut_after) >= header_timeout - 0.5, a.slow_cut_after
        assert not [k for k in plain_recorder.seen if k.startswith("slow-")]
        bad = [o for o in a.outcomes["half-head"] if o != "408 header_timeout"]
        assert len(a.outcomes["half-head"]) == 666 and not bad, f"half heads: {bad[:10]}"
        assert fds1 <= fds0 + 16, f"descriptors {fds0} -> {fds1}: connections kept"
        # a round holds ~70 MiB (~29% of the baseline) of per-connection state: kept, it shows
        # here; the allocator's own high-water drift measured +3% to +13% over the baseline
        assert rss1 <= rss0 * 1.20, (f"RSS {rss0 // 1024} MiB after warm-up, peak "
                                     f"{peak // 1024} MiB, {rss1 // 1024} MiB after the round")
    finally:
        finish(sp)
