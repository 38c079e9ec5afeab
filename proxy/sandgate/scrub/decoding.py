"""Undo a body's content codings: a response's so that it can be scrubbed, a request's so that
the exfiltration check reads what the upstream will decode (`sandgate.stages.forward`).

Sandgate asks every upstream for `Accept-Encoding: identity`; some answer compressed anyway.
What a well-kept library decodes is decoded here, streaming, layer by layer in the reverse of
the order the upstream applied them (`Content-Encoding: gzip, br` is gzip first, then br):
gzip and deflate (zlib, several gzip members included), br (Brotli, which mitmproxy already
depends on) and zstd (zstandard, likewise, with the 8 MiB window RFC 8878 sets for HTTP). The
sandbox then gets the plain, scrubbed body without the Content-Encoding header. Any other coding
is refused with a readable 502 (`unsupported` says why); it is never passed on unscrubbed.

Bounded: compressed input is fed to br and zstd in slices of `_SLICE` bytes and to zlib with a
cap on each output, so one call never inflates more than one slice can hold (zstd at most one
128 KiB block per 3 input bytes, zlib `_ZLIB_OUT`); a body read whole (`decode_all`) is refused
past `limit` decoded bytes. Time is linear in the input and output.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import brotli
import zstandard

from sandgate.errors import InvalidInput

_SLICE = 1024
_ZLIB_OUT = 1024 * 1024
_ZSTD_WINDOW = 8 * 1024 * 1024  # RFC 8878 section 3.1.1.1.2: what an HTTP decoder must take

_ZLIB_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
               "deflate": zlib.MAX_WBITS}
SUPPORTED = frozenset({*_ZLIB_WBITS, "br", "zstd"})


def codings(header: str) -> list[str]:
    """The codings of a Content-Encoding value in the order they were applied (identity and
    empty members dropped), lower-cased."""
    return [c for c in (p.strip().lower() for p in header.split(",")) if c not in ("", "identity")]


def unsupported(chain: list[str]) -> str | None:
    """Why a body with these codings cannot be scrubbed, or None when it can."""
    bad = sorted({c for c in chain if c not in SUPPORTED})
    if bad:
        return (f"the upstream sent a body in content coding(s) {', '.join(bad)}, which "
                "Sandgate cannot decode to scrub; nothing of it was sent")
    return None


class _Zlib:
    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.wbits = _ZLIB_WBITS[coding]
        self.d = zlib.decompressobj(self.wbits)

    def feed(self, data: bytes) -> Iterator[bytes]:
        try:
            while data:
                out = self.d.decompress(data, _ZLIB_OUT)
                if out:
                    yield out
                data = self.d.unconsumed_tail
                if self.d.eof and self.d.unused_data:
                    if self.coding == "deflate":
                        return  # one zlib stream only: trailing bytes are not part of it
                    data = self.d.unused_data  # another gzip member follows
                    self.d = zlib.decompressobj(self.wbits)
        except zlib.error:
            raise ValueError(f"the upstream's {self.coding} body is corrupt") from None

    def end(self) -> Iterator[bytes]:
        out = self.d.flush()
        if out:
            yield out

    @property
    def finished(self) -> bool:
        """The last stream (gzip member) ended: the body is not cut short."""
        return self.d.eof


class _Sliced:
    """br or zstd: the compressed input goes in `_SLICE`-byte slices (see the module). zstd's
    frames are decoded one after the other (a body may hold several), each by its own object,
    so that whether the last one ended is known (`finished`)."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._br: brotli.Decompressor | None = None
        self._zstd: zstandard.ZstdDecompressionObj | None = None
        self._fresh = True  # nothing of the current br stream or zstd frame read yet
        if coding == "br":
            self._br = brotli.Decompressor()
            self.errors: tuple[type[Exception], ...] = (brotli.error,)
        else:
            self._zstd = _zstd_frame()
            self.errors = (zstandard.ZstdError,)

    def _step(self, data: bytes) -> Iterator[bytes]:
        if self._br is not None:
            self._fresh = False
            yield self._br.process(data)
            return
        while data:
            assert self._zstd is not None
            self._fresh = False
            yield self._zstd.decompress(data)
            if not self._zstd.eof:
                return
            data = self._zstd.unused_data  # another frame follows
            self._zstd, self._fresh = _zstd_frame(), True

    def feed(self, data: bytes) -> Iterator[bytes]:
        for i in range(0, len(data), _SLICE):
            try:
                for out in self._step(data[i:i + _SLICE]):
                    if out:
                        yield out
            except self.errors:
                raise ValueError(f"the upstream's {self.coding} body is corrupt") from None

    def end(self) -> Iterator[bytes]:
        return iter(())

    @property
    def finished(self) -> bool:
        """The body is not cut short: the br stream ended, or no zstd frame is half read."""
        if self._br is not None:
            return bool(self._br.is_finished())
        return self._fresh


def _zstd_frame() -> zstandard.ZstdDecompressionObj:
    return zstandard.ZstdDecompressor(max_window_size=_ZSTD_WINDOW).decompressobj()


def _layer(coding: str) -> _Zlib | _Sliced:
    return _Sliced(coding) if coding in ("br", "zstd") else _Zlib(coding)


class Decoder:
    """Streaming decoder of a chain of codings (as `codings` lists them). `feed` and `end`
    yield decoded pieces; ValueError (message without body bytes) when the body is corrupt."""

    def __init__(self, chain: list[str]) -> None:
        assert unsupported(chain) is None
        self._layers = [_layer(c) for c in reversed(chain)]  # the last applied is undone first

    def feed(self, data: bytes) -> Iterator[bytes]:
        return self._through(0, [data], final=False)

    def end(self) -> Iterator[bytes]:
        return self._through(0, [], final=True)

    @property
    def finished(self) -> bool:
        """Every layer's stream ended (after `end`): the body was not cut short."""
        return all(layer.finished for layer in self._layers)

    def _through(self, i: int, pieces: list[bytes] | Iterator[bytes],
                 final: bool) -> Iterator[bytes]:
        if i == len(self._layers):
            yield from pieces
            return
        layer = self._layers[i]

        def out() -> Iterator[bytes]:
            for piece in pieces:
                yield from layer.feed(piece)
            if final:
                yield from layer.end()

        yield from self._through(i + 1, out(), final)


class TooLarge(InvalidInput):
    """`decode_all`: the body decodes to more than the limit (a ValueError, as corrupt is)."""


def decode_all(data: bytes, chain: list[str], limit: int, *, whole: bool = False) -> bytes:
    """A whole body decoded; ValueError when corrupt, `TooLarge` when it decodes to more than
    `limit` (decoding stops there: a decompression bomb costs `limit` bytes at most). `whole`:
    a body cut short (a stream that does not end) is corrupt too."""
    decoder = Decoder(chain)
    out = bytearray()
    for part in (decoder.feed(data), decoder.end()):
        for piece in part:
            out += piece
            if len(out) > limit:
                raise TooLarge(f"the upstream's {', '.join(chain)} body decodes to more "
                               "than Sandgate inspects")
    if whole and not decoder.finished:
        raise ValueError(f"the {', '.join(chain)} body is cut short")
    return bytes(out)
