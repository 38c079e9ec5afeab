"""Streamed events and the text a client joins across them: a pure parser.

An LLM API streams its answer as many small events (server-sent events, NDJSON lines, the elements
of a JSON array, WebSocket messages), each carrying a *delta*: a piece of a string that the client
appends to the pieces before it. A secret cut between two deltas is in no single event, so the
per-body scrubber (`sandgate.scrub.scrubber`) cannot see it; the client's joined text holds it
whole. This module finds those pieces; `sandgate.scrub.joined` scrubs their join.

Framing (`framer`): an event is cut out of the byte stream only when it is complete, and its
bytes are kept exactly, so an event nothing is changed in leaves byte-identical.

Leaves (`leaves`): every string value of an event's JSON document (or its whole data, when
that is not JSON) is a *leaf* with a *key*; the leaves with one key, in stream order, are what
a client joins. The key of a leaf is its JSON path (successive events with a string at the same
path: a generic delta stream, MCP's included), except for the formats whose clients join by an
index carried in the event:

- Anthropic Messages: ``content_block_delta``'s ``delta.text`` / ``partial_json`` /
  ``thinking``, per content block ``index``;
- OpenAI chat completions: ``choices[i].delta.content`` / ``refusal`` / ...,
  per choice ``index``, and ``tool_calls[j].function.arguments`` per tool call ``index``;
- OpenAI Responses and Realtime: the ``delta`` string of every ``*.delta`` event, per
  ``item_id`` / ``output_index`` / ``content_index`` / ``summary_index``;
- Gemini: the ``text`` of every part of ``candidates[i].content.parts``, per candidate.

`ended` names the keys an event closes (``content_block_stop``, a ``finish_reason``, a
``*.done`` event, ``[DONE]``): nothing more is appended to them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Key = tuple[Any, ...]
Path = tuple[str | int, ...]

Format = Literal["sse", "ndjson", "json-seq", "json-array"]

# The key of a whole event data that is not JSON (plain text deltas).
TEXT_KEY: Key = ("text",)
# The path of that leaf: the event's data itself.
WHOLE: Path = ()


def stream_format(content_type: str, path: str = "") -> Format | None:
    """Which event framing a response body of this Content-Type has (None: not a stream of
    events). A JSON body is read as a stream of array elements only when it answers Gemini's
    ``streamGenerateContent`` (`path`: the request's path): other JSON bodies are documents,
    scrubbed whole, and parsing every large JSON download element by element would be slow."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "text/event-stream":
        return "sse"
    if media in ("application/x-ndjson", "application/jsonl", "application/x-jsonlines",
                 "application/jsonlines", "application/stream+json", "application/ndjson"):
        return "ndjson"
    if media == "application/json-seq":
        return "json-seq"
    if media == "application/json" and ":streamGenerateContent" in path:
        return "json-array"  # Gemini's streamGenerateContent without alt=sse: a JSON array
    return None


@dataclass(slots=True)
class Event:
    """One complete event: its exact bytes, and where its payload sits in them.

    ``raw[:start] + payload + raw[end:]`` is ``raw`` for every framing but SSE, whose payload
    is the data lines joined (`rebuild` writes the lines again).
    """

    raw: bytes
    payload: bytes | None  # None: an event with no data (a comment, a separator)
    fmt: Format
    start: int = 0
    end: int = 0

    def rebuild(self, payload: bytes) -> bytes:
        """The event with its payload replaced, framed as before."""
        if self.fmt != "sse":
            return self.raw[:self.start] + payload + self.raw[self.end:]
        return _sse_rebuild(self.raw, payload)


class Framer(Protocol):
    def feed(self, chunk: bytes) -> list[Event]: ...

    def end(self) -> list[Event]:
        """The stream ended: what is left, as a last event (clients differ on whether they
        act on an unterminated one, so it is joined like any other)."""
        ...

    @property
    def pending(self) -> int: ...


_LINE = re.compile(rb"\r\n|\n|\r")


class SseFramer:
    """Server-sent events: an event ends with an empty line (`\\n`, `\\r\\n` or `\\r`)."""

    def __init__(self) -> None:
        self._buf = b""
        self._scan = 0  # where the next line starts in _buf
        self._event_start = 0

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[Event]:
        self._buf += chunk
        out: list[Event] = []
        buf = self._buf
        while True:
            m = _LINE.search(buf, self._scan)
            # a CR at the end may be the first half of CRLF: wait for the next byte
            if m is None or (m.group() == b"\r" and m.end() == len(buf)):
                break
            empty = m.start() == self._scan
            self._scan = m.end()
            if empty:
                raw = buf[self._event_start:self._scan]
                self._event_start = self._scan
                out.append(Event(raw, _sse_data(raw), "sse"))
        if self._event_start:
            self._buf = buf[self._event_start:]
            self._scan -= self._event_start
            self._event_start = 0
        return out

    def end(self) -> list[Event]:
        rest, self._buf, self._scan = self._buf, b"", 0
        return [Event(rest, _sse_data(rest), "sse")] if rest else []


def _sse_lines(raw: bytes) -> list[tuple[bytes, bytes]]:
    """(line, its terminator) of an event's bytes, the final empty line included."""
    out: list[tuple[bytes, bytes]] = []
    pos = 0
    for m in _LINE.finditer(raw):
        out.append((raw[pos:m.start()], m.group()))
        pos = m.end()
    if pos < len(raw):
        out.append((raw[pos:], b""))
    return out


def _field_value(line: bytes) -> tuple[bytes, bytes]:
    # a stream may begin with a byte order mark, which clients skip
    name, colon, value = line.removeprefix(b"\xef\xbb\xbf").partition(b":")
    return name, (value[1:] if value.startswith(b" ") else value) if colon else b""


def _sse_data(raw: bytes) -> bytes | None:
    data = [_field_value(line)[1] for line, _ in _sse_lines(raw)
            if line and _field_value(line)[0] == b"data"]
    return b"\n".join(data) if data else None


def _sse_rebuild(raw: bytes, payload: bytes) -> bytes:
    """The event's lines, its data lines replaced by `payload`'s lines where the first was."""
    out: list[bytes] = []
    written = False
    for line, term in _sse_lines(raw):
        if line and _field_value(line)[0] == b"data":
            if not written:
                written = True
                out.extend(b"data: " + part + (term or b"\n")
                           for part in _LINE.split(payload))
            continue
        out.append(line + term)
    return b"".join(out)


class LineFramer:
    """NDJSON (one document a line) and RFC 7464 JSON text sequences (RS, document, LF)."""

    def __init__(self, fmt: Format) -> None:
        self._fmt = fmt
        self._buf = b""

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[Event]:
        self._buf += chunk
        if b"\n" not in chunk:
            return []
        *lines, self._buf = self._buf.split(b"\n")
        return [self._event(line + b"\n") for line in lines]

    def _event(self, raw: bytes) -> Event:
        start = 1 if self._fmt == "json-seq" and raw.startswith(b"\x1e") else 0
        end = len(raw) - (2 if raw.endswith(b"\r\n") else 1 if raw.endswith(b"\n") else 0)
        if end <= start or not raw[start:end].strip():
            return Event(raw, None, self._fmt)
        return Event(raw, raw[start:end], self._fmt, start, end)

    def end(self) -> list[Event]:
        rest, self._buf = self._buf, b""
        return [self._event(rest)] if rest else []


_STRING_STOP = re.compile(rb'["\\]')


class ArrayFramer:
    """A JSON array sent element by element (Gemini's stream without ``alt=sse``): each
    element is an event, the bytes before it (``[``, ``,``, spaces) its prefix. A body that
    does not start with ``[`` is not a stream of elements: `passthrough` turns True."""

    def __init__(self) -> None:
        self._buf = b""
        self._i = 0  # scan position in _buf
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._elem = -1  # where the current element starts in _buf, -1: between elements
        self._started = False
        self.passthrough = False

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[Event]:
        self._buf += chunk
        out: list[Event] = []
        buf = self._buf
        if not self._started:
            head = buf.lstrip()
            if not head:
                return []
            if not head.startswith(b"["):
                self.passthrough = True
                return []
            self._started = True
            self._i = len(buf) - len(head) + 1
        cut = 0
        i, n = self._i, len(buf)
        while i < n:
            if self._in_string:
                if self._escape:
                    self._escape = False
                    i += 1
                    continue
                m = _STRING_STOP.search(buf, i)  # strings are most of the bytes: skip them
                if m is None:
                    i = n
                    break
                i = m.start()
                if buf[i] == 0x5C:
                    self._escape = True
                else:
                    self._in_string = False
                i += 1
                continue
            c = buf[i]
            if c in b" \t\r\n,]" and self._elem < 0:
                pass
            elif self._elem < 0:
                self._elem = i
                self._depth = 0
                continue  # look at this byte again as the element's first
            elif c == 0x22:
                self._in_string = True
            elif c in b"{[":
                self._depth += 1
            elif c in b"}]":
                self._depth -= 1
                if self._depth <= 0:
                    end = i + 1 if self._depth == 0 else i
                    out.append(Event(buf[cut:end], buf[self._elem:end], "json-array",
                                     self._elem - cut, end - cut))
                    cut, self._elem, self._depth = end, -1, 0
                    i = end
                    continue
            elif c in b", \t\r\n" and self._depth == 0:
                # the end of a scalar element
                out.append(Event(buf[cut:i], buf[self._elem:i], "json-array",
                                 self._elem - cut, i - cut))
                cut, self._elem = i, -1
            i += 1
        self._buf = buf[cut:]
        self._i = i - cut
        if self._elem >= 0:
            self._elem -= cut
        return out

    def end(self) -> list[Event]:
        """The closing bracket, or an element the stream cut (no client can parse it)."""
        rest, self._buf = self._buf, b""
        return [Event(rest, None, "json-array")] if rest else []


def framer(fmt: Format) -> SseFramer | LineFramer | ArrayFramer:
    if fmt == "sse":
        return SseFramer()
    if fmt == "json-array":
        return ArrayFramer()
    return LineFramer(fmt)


# --- leaves -------------------------------------------------------------------------------


@dataclass(slots=True)
class Parsed:
    """An event's payload read: the JSON document (or the text), its leaves, the keys it ends."""

    doc: Any
    leaves: list[tuple[Key, Path, str]]
    ended: list[Key]
    is_json: bool


def parse(payload: bytes) -> Parsed | None:
    """The leaves of one event's payload; None when it is not UTF-8 or nested too deep to walk
    (nothing is joined: the per-body scrub still applies). Never raises."""
    try:
        return _parse(payload.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError):
        return None


def _parse(text: str) -> Parsed:
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict | list | str):
        # not JSON, or a bare number or literal: a text delta such as "2024" is text too
        done = text.strip() == "[DONE]"
        return Parsed(text, [] if done else [(TEXT_KEY, WHOLE, text)], [()] if done else [],
                      False)
    if isinstance(doc, str):
        return Parsed(doc, [(("json",), WHOLE, doc)], [], True)
    return Parsed(doc, list(_leaves(doc)), _ended(doc), True)


def _walk(node: Any, path: Path) -> Iterator[tuple[Path, str]]:
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, (*path, i))


def _index(node: Any, default: Any) -> Any:
    i = node.get("index", default) if isinstance(node, dict) else default
    return i if isinstance(i, int | str) else default


def _leaves(doc: Any) -> Iterator[tuple[Key, Path, str]]:
    for path, text in _walk(doc, ()):
        yield _key(doc, path), path, text


def _key(doc: Any, path: Path) -> Key:
    """The key a client joins the string at `path` under (see the module docstring)."""
    if isinstance(doc, dict):
        typ = doc.get("type")
        if typ == "content_block_delta" and path[:1] == ("delta",):
            return ("anthropic", _index(doc, 0), *path[1:])
        if typ == "content_block_start" and path[:1] == ("content_block",):
            return ("anthropic", _index(doc, 0), *path[1:])  # the block's first text
        if isinstance(typ, str) and typ.endswith(".delta") and path == ("delta",):
            return ("responses", typ.removesuffix("delta"), *_item(doc))
        if path[:1] == ("choices",) and len(path) >= 3 and path[2] == "delta":
            choice = doc["choices"][path[1]]
            rest: Path = path[3:]
            if rest[:1] == ("tool_calls",) and len(rest) >= 2 and isinstance(rest[1], int):
                call = choice["delta"]["tool_calls"][rest[1]]
                return ("chat", _index(choice, path[1]), "tool_calls", _index(call, rest[1]),
                        *rest[2:])
            return ("chat", _index(choice, path[1]), *rest)
        if (path[:1] == ("candidates",) and len(path) == 6 and path[2:4] == ("content", "parts")
                and path[5] == "text"):
            return ("gemini", _index(doc["candidates"][path[1]], path[1]), "text")
    return ("json", *path)


def _item(doc: dict[str, Any]) -> tuple[Any, ...]:
    """The indexes a Responses or Realtime delta is joined by (a key must be hashable: any
    other value counts as absent)."""
    return tuple(v if isinstance(v, int | str) else None
                 for v in (doc.get(k) for k in ("item_id", "output_index", "content_index",
                                                "summary_index")))


def _ended(doc: Any) -> list[Key]:
    """Key prefixes this event closes: what a client joins under them is complete."""
    if not isinstance(doc, dict):
        return []
    typ = doc.get("type")
    if typ == "content_block_stop":
        return [("anthropic", _index(doc, 0))]
    if typ == "message_stop":
        return [("anthropic",)]
    if isinstance(typ, str) and typ.endswith(".done"):
        return [("responses", typ.removesuffix("done"), *_item(doc))]
    out: list[Key] = []
    for name, prefix in (("choices", "chat"), ("candidates", "gemini")):
        items = doc.get(name)
        if isinstance(items, list):
            for i, item in enumerate(items):
                if isinstance(item, dict) and (item.get("finish_reason")
                                               or item.get("finishReason")):
                    out.append((prefix, _index(item, i)))
    return out


def with_leaves(parsed: Parsed, new: dict[Path, str]) -> bytes:
    """The payload again with the leaves at the paths of `new` replaced (JSON re-encoded)."""
    if not parsed.is_json:
        text: str = new.get(WHOLE, parsed.doc)
        return text.encode("utf-8", "surrogatepass")
    doc = parsed.doc
    if WHOLE in new:
        doc = new[WHOLE]
    else:
        for path, text in new.items():
            node = doc
            for step in path[:-1]:
                node = node[step]
            node[path[-1]] = text
    try:
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (an emoji cut between deltas): escape it
        return json.dumps(doc, separators=(",", ":")).encode("ascii")
