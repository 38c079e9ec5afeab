"""LLM API calls: which API a request speaks, what it asks for, and what it spent. Pure.

Sandgate injects the LLM keys, so it sees every inference call a sandbox makes. This module
knows the calls of the APIs the official SDKs speak:

- Anthropic Messages (`POST .../v1/messages`): `model`, `max_tokens`, `stream` in the body;
- OpenAI chat completions (`POST .../chat/completions`): `model`, `max_completion_tokens` or
  `max_tokens`, `stream`, `stream_options.include_usage`;
- OpenAI Responses (`POST .../responses`): `model`, `max_output_tokens`, `stream`;
- Gemini (`POST .../models/MODEL:generateContent` / `:streamGenerateContent`): the model in the
  path, `generationConfig.maxOutputTokens`; streaming by the method.

A request is recognised by its host and path (`recognise`), or, for OpenAI-compatible servers
and proxies on other hosts, by the `api:` a rule declares. Bodies are read strictly
(`read_call`): a body Sandgate cannot read the model and cap of the way the upstream will (not
a JSON object, a key given twice, a cap that is not a whole number) is refused, never guessed.

The answer's usage (`UsageReader`): a JSON body's `usage` / `usageMetadata`; in streams (framed
by sandgate.scrub.deltas, the event parser the joined-text scrub uses) Anthropic's `message_start` /
`message_delta`, OpenAI's final usage chunk, the Responses API's `response.completed`, and
Gemini's `usageMetadata` (each chunk carries the running total). Cached and reasoning tokens
are read where the API reports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from sandgate.errors import InvalidInput
from sandgate.scrub import deltas

# The APIs as this module names them. A rule declares "anthropic", "openai" (chat completions
# and Responses, told apart by the path) or "gemini".
Api = Literal["anthropic", "openai-chat", "openai-responses", "gemini"]
DeclaredApi = Literal["anthropic", "openai", "gemini"]
DECLARED: tuple[DeclaredApi, ...] = ("anthropic", "openai", "gemini")

# The providers' own hosts: recognised without a declaration.
KNOWN_HOSTS: dict[str, DeclaredApi] = {
    "api.anthropic.com": "anthropic",
    "api.openai.com": "openai",
    "generativelanguage.googleapis.com": "gemini",
}

# How much of a non-streamed answer is kept to read its usage (bigger answers: usage unknown,
# audited as such; the answer itself is never held back for it).
MAX_USAGE_BODY = 8 * 1024 * 1024


def _api_of_path(family: DeclaredApi, path: str) -> Api | None:
    p = path.partition("?")[0].rstrip("/")
    if family == "anthropic":
        return "anthropic" if p.endswith("/messages") else None
    if family == "openai":
        if p.endswith("/chat/completions"):
            return "openai-chat"
        if p.endswith("/responses"):
            return "openai-responses"
        return None
    last = p.rsplit("/", 1)[-1]
    return "gemini" if last.endswith((":generateContent", ":streamGenerateContent")) else None


def recognise(method: str, host: str, path: str,
              declared: DeclaredApi | None = None) -> Api | None:
    """The API a request calls: by the rule's declaration, else by the provider's own host;
    None when it is no inference call (a model list, a file upload, a token count)."""
    if method.upper() != "POST":
        return None
    family = declared or KNOWN_HOSTS.get(host.lower().rstrip("."))
    return None if family is None else _api_of_path(family, path)


@dataclass(frozen=True, slots=True)
class LlmCall:
    """What an inference request asks for."""

    api: Api
    model: str | None  # None: the body (or path) names none
    max_tokens: int | None  # the output cap the upstream will apply (None: the model's own)
    stream: bool
    include_usage: bool = False  # OpenAI chat: the client asked for the final usage chunk
    input_bytes: int = 0  # the body's size: the worst case of its input tokens


def stated_call(model: str | None, max_tokens: int | None = None) -> LlmCall | None:
    """The call a fixture (`model:`) or `explain --model` states: judged by its model and cap
    alone (the API does not change a decision). None without a model."""
    if model is None:
        return None
    return LlmCall("openai-chat", model, max_tokens, False)


class CallUnreadable(InvalidInput):
    """The body cannot be read as the upstream will read it: refused, never guessed."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            # servers differ on which of two values they use: one Sandgate did not judge
            raise CallUnreadable(f"the key {k!r} is given twice")
        out[k] = v
    return out


# json.loads(body, object_pairs_hook=...) builds a decoder per call: one, reused (it keeps no
# state between documents)
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates)


def _document(body: bytes) -> dict[str, Any]:
    try:
        # as json.loads reads bytes: UTF-8, -16 or -32 by their first bytes
        doc = _DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except CallUnreadable:
        raise
    except (ValueError, RecursionError):
        raise CallUnreadable("the body is not JSON") from None
    if not isinstance(doc, dict):
        raise CallUnreadable("the body is not a JSON object")
    return doc


def _whole(doc: dict[str, Any], key: str) -> int | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CallUnreadable(f"{key} is not a whole number")
    return v


# Each API's spellings of the output cap (the proto JSON of Gemini takes both cases).
CAP_KEYS: dict[Api, tuple[str, ...]] = {
    "anthropic": ("max_tokens",),
    "openai-chat": ("max_completion_tokens", "max_tokens"),
    "openai-responses": ("max_output_tokens",),
    "gemini": ("maxOutputTokens", "max_output_tokens"),
}


def _cap_holder(api: Api, doc: dict[str, Any], create: bool) -> dict[str, Any] | None:
    if api != "gemini":
        return doc
    for key in ("generationConfig", "generation_config"):
        held = doc.get(key)
        if isinstance(held, dict):
            return held
        if held is not None:
            raise CallUnreadable(f"{key} is not an object")
    if create:
        made: dict[str, Any] = {}
        doc["generationConfig"] = made
        return made
    return None


def gemini_model(path: str) -> str | None:
    """The model a Gemini path names: .../models/MODEL:generateContent -> MODEL."""
    last = path.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]
    model = last.rpartition(":")[0]
    return model or None


def read_call(api: Api, path: str, body: bytes) -> LlmCall:
    """The model, output cap and streaming of a request body (CallUnreadable: refuse)."""
    doc = _document(body)
    if api == "gemini":
        model = gemini_model(path)
        stream = path.partition("?")[0].rstrip("/").endswith(":streamGenerateContent")
    else:
        m = doc.get("model")
        if m is not None and not isinstance(m, str):
            raise CallUnreadable("model is not a string")
        model = m
        s = doc.get("stream", False)
        if s is not None and not isinstance(s, bool):
            raise CallUnreadable("stream is not true or false")
        stream = bool(s)
    holder = _cap_holder(api, doc, create=False)
    caps = [c for c in (_whole(holder, k) for k in CAP_KEYS[api]) if c is not None] \
        if holder is not None else []
    include_usage = False
    if api == "openai-chat":
        opts = doc.get("stream_options")
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    # two spellings given: the upstream applies one of them; the larger is the worst case
    return LlmCall(api, model, max(caps) if caps else None, stream, include_usage, len(body))


def read_ws_message(body: bytes) -> tuple[str, LlmCall | None]:
    """A client message of the Responses API's WebSocket transport: its `type`, and the call
    a `response.create` makes (its other keys are the body a POST would send); None for any
    other type (CallUnreadable: not one JSON object with a string `type`)."""
    doc = _document(body)
    kind = doc.get("type")
    if not isinstance(kind, str):
        raise CallUnreadable("the message has no string `type`")
    if kind != "response.create":
        return kind, None
    return kind, read_call("openai-responses", "", body)


def with_max_tokens(api: Api, body: bytes, cap: int) -> bytes:
    """The body with its output cap set to `cap` in every spelling it uses (the API's first
    spelling when it uses none)."""
    doc = _document(body)
    holder = _cap_holder(api, doc, create=True)
    assert holder is not None
    keys = [k for k in CAP_KEYS[api] if k in holder] or [CAP_KEYS[api][0]]
    for k in keys:
        holder[k] = cap
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


def with_usage_chunk(body: bytes) -> bytes:
    """An OpenAI chat stream request that asks for the final usage chunk."""
    doc = _document(body)
    opts = doc.get("stream_options")
    doc["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


# --- usage ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens an answer reports. `input_tokens` counts every input token (cached ones too);
    `cached_tokens` those of them read from the provider's cache; `output_tokens` every output
    token (reasoning ones too), `reasoning_tokens` those of them spent thinking."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def doc(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cached_tokens": self.cached_tokens,
                "reasoning_tokens": self.reasoning_tokens}


def _n(d: Any, *path: str) -> int:
    for key in path:
        if not isinstance(d, dict):
            return 0
        d = d.get(key)
    return d if isinstance(d, int) and not isinstance(d, bool) and d >= 0 else 0


def _anthropic(u: Any) -> Usage:
    cached = _n(u, "cache_read_input_tokens")
    return Usage(_n(u, "input_tokens") + cached + _n(u, "cache_creation_input_tokens"),
                 _n(u, "output_tokens"), cached)


def usage_of(api: Api, doc: Any) -> Usage | None:
    """The usage a whole JSON answer (or one streamed event of the OpenAI APIs and Gemini)
    reports; None when it reports none."""
    if not isinstance(doc, dict):
        return None
    if api == "gemini":
        u = doc.get("usageMetadata")
        if not isinstance(u, dict):
            return None
        thoughts = _n(u, "thoughtsTokenCount")
        return Usage(_n(u, "promptTokenCount"), _n(u, "candidatesTokenCount") + thoughts,
                     _n(u, "cachedContentTokenCount"), thoughts)
    if api == "openai-responses" and isinstance(doc.get("response"), dict):
        doc = doc["response"]  # a streamed response.completed / .incomplete / .failed
    u = doc.get("usage")
    if not isinstance(u, dict):
        return None
    if api == "anthropic":
        return _anthropic(u)
    if api == "openai-chat":
        return Usage(_n(u, "prompt_tokens"), _n(u, "completion_tokens"),
                     _n(u, "prompt_tokens_details", "cached_tokens"),
                     _n(u, "completion_tokens_details", "reasoning_tokens"))
    return Usage(_n(u, "input_tokens"), _n(u, "output_tokens"),
                 _n(u, "input_tokens_details", "cached_tokens"),
                 _n(u, "output_tokens_details", "reasoning_tokens"))


def _anthropic_event(doc: Any, seen: Usage | None) -> Usage | None:
    """message_start carries the input (and a first output count); message_delta the running
    output total (and, from some versions, the input again)."""
    if not isinstance(doc, dict):
        return seen
    kind = doc.get("type")
    if kind == "message_start":
        msg = doc.get("message")
        u = msg.get("usage") if isinstance(msg, dict) else None
        return _anthropic(u) if isinstance(u, dict) else seen
    if kind == "message_delta" and isinstance(doc.get("usage"), dict):
        u = doc["usage"]
        base = seen or Usage()
        has_input = any(k in u for k in ("input_tokens", "cache_read_input_tokens",
                                         "cache_creation_input_tokens"))
        now = _anthropic(u)
        return Usage(now.input_tokens if has_input else base.input_tokens,
                     max(now.output_tokens, base.output_tokens),
                     now.cached_tokens if has_input else base.cached_tokens)
    return seen


def is_usage_chunk(doc: Any) -> bool:
    """OpenAI's final usage chunk: no choices, the usage."""
    return isinstance(doc, dict) and doc.get("choices") == [] and isinstance(
        doc.get("usage"), dict)


class UsageReader:
    """Reads the usage of an answer as it passes, without changing it, except that the OpenAI
    usage chunk Sandgate asked for (`drop_usage_chunk`: the client did not) is taken out so the
    client sees the events it would have seen.

    `feed(chunk)` returns the bytes to pass on: the chunk itself, or (dropping) the complete
    events it ends, all but that chunk; `end()` the rest. `usage` is what was read so far."""

    def __init__(self, api: Api, content_type: str, path: str,
                 drop_usage_chunk: bool = False) -> None:
        self.api = api
        self.usage: Usage | None = None
        fmt = deltas.stream_format(content_type, path)
        self._framer = deltas.framer(fmt) if fmt is not None else None
        self._whole: bytearray | None = bytearray() if fmt is None else None
        self._drop = drop_usage_chunk and fmt is not None and api == "openai-chat"
        self.dropped = 0

    def feed(self, chunk: bytes) -> bytes:
        if self._framer is None:
            if self._whole is not None:
                if len(self._whole) + len(chunk) > MAX_USAGE_BODY:
                    self._whole = None  # too big to read: usage unknown
                else:
                    self._whole += chunk
            return chunk
        events = self._framer.feed(chunk)
        kept = self._events(events)
        return b"".join(kept) if self._drop else chunk

    def end(self) -> bytes:
        if self._framer is None:
            if self._whole:
                try:
                    self.usage = usage_of(self.api, json.loads(self._whole))  # no copy
                except (ValueError, RecursionError):
                    pass
            self._whole = None
            return b""
        kept = self._events(self._framer.end())
        return b"".join(kept) if self._drop else b""

    def _events(self, events: list[deltas.Event]) -> list[bytes]:
        kept: list[bytes] = []
        for ev in events:
            doc: Any = None
            if ev.payload is not None and ev.payload.strip()[:1] in (b"{", b"["):
                try:
                    doc = json.loads(ev.payload)
                except (ValueError, RecursionError):
                    doc = None
            if self.api == "anthropic":
                self.usage = _anthropic_event(doc, self.usage)
            else:
                found = usage_of(self.api, doc)
                if found is not None:
                    self.usage = found
            if self._drop and is_usage_chunk(doc):
                self.dropped += 1
                continue
            kept.append(ev.raw)
        return kept
