"""The JSON-RPC 2.0 request parser: a POSTed body as the calls it carries (MCP's streamable HTTP
sends one message or a batch per POST).

Strict on purpose: a body two parsers could read differently is refused, never guessed
(duplicate keys, non-UTF-8, a BOM, NaN/Infinity, lone surrogates, a version other than "2.0",
members JSON-RPC does not define, a batch reusing an id). What the upstream acts on is then
exactly what was judged. Pure: no I/O, no policy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sandgate.errors import InvalidInput

# What a tools/call, resources/read or prompts/get names: (method, the params member). The
# subscriptions name their resource too (MCP's Mcp-Name header mirrors it: sandgate.rpc.mcpheaders).
NAMED = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri",
         "resources/subscribe": "uri", "resources/unsubscribe": "uri"}
# MCP 2026-07-28 (stateless): each request carries its protocol version in params._meta.
VERSION_META = "io.modelcontextprotocol/protocolVersion"

_REQUEST_KEYS = frozenset({"jsonrpc", "method", "params", "id"})
_RESPONSE_KEYS = frozenset({"jsonrpc", "id", "result", "error"})

Id = int | str


class CallError(InvalidInput):
    """The body is not a well-formed JSON-RPC 2.0 message or batch (a safe, short reason)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One JSON-RPC message as the policy sees it."""

    kind: Literal["request", "notification", "response"]
    method: str | None = None  # None for a response
    id: Id | None = None  # None for a notification
    # tools/call and prompts/get: the name; resources/read: the uri; otherwise None
    name: str | None = None
    # tools/call's arguments; None: not known (a name-only question, e.g. filtering a list)
    arguments: Mapping[str, Any] | None = None
    args_bytes: int = 0  # size of the arguments as sent (audit: never the arguments)
    args_sha256: str | None = None
    # params._meta's MCP protocol version (2026-07-28 requests carry one), else None
    version: str | None = None

    @property
    def tool(self) -> str | None:
        return self.name if self.method == "tools/call" else None

    @property
    def shown(self) -> str:
        """The message in one phrase, for reasons: "tool delete_repo", "method ping"."""
        if self.kind == "response":
            return "a response"
        if self.method == "tools/call":
            return f"tool {self.name}"
        if self.method == "prompts/get":
            return f"prompt {self.name}"
        if self.method == "resources/read":
            return f"resource {self.name}"
        return f"method {self.method}"


@dataclass(frozen=True, slots=True)
class Call:
    """The messages of one POST, in order; `batch` when they came as a JSON array."""

    messages: tuple[Message, ...]
    batch: bool = False

    @property
    def ids(self) -> tuple[Id, ...]:
        """The ids of its requests (what a JSON-RPC answer must respond to)."""
        return tuple(m.id for m in self.messages if m.kind == "request" and m.id is not None)


def tool_call(name: str, arguments: Mapping[str, Any] | None = None, id: Id = 1) -> Call:
    """A one-message call of a tool (explain, fixtures, list filtering)."""
    return Call((Message("request", "tools/call", id, name, arguments),))


def method_call(method: str, name: str | None = None, id: Id = 1) -> Call:
    return Call((Message("request", method, id, name, None),))


def id_key(value: Id) -> str:
    """An id as a dictionary key that keeps 1 and "1" apart."""
    return json.dumps(value)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise CallError(f"the JSON repeats the key {k[:60]!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise CallError(f"the JSON contains {name}, which JSON does not define")


def _check_text(value: Any) -> None:
    """No lone surrogates anywhere (from \\ud800 escapes): parsers disagree on them."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise CallError("the JSON contains a lone surrogate escape") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def loads(body: bytes) -> Any:
    """Strict JSON: UTF-8 without BOM, no duplicate keys, no NaN/Infinity, no lone surrogates."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise CallError("the body is not UTF-8") from None
    if text.startswith("\ufeff"):
        raise CallError("the body starts with a byte order mark")
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except CallError:
        raise
    except RecursionError:
        raise CallError("the JSON is nested too deeply") from None
    except ValueError as e:
        raise CallError(f"the body is not valid JSON ({str(e)[:80]})") from None
    _check_text(doc)
    return doc


def parse(body: bytes) -> Call:
    """A POSTed JSON-RPC body as its messages; raises CallError for anything else."""
    doc = loads(body)
    if isinstance(doc, list):
        if not doc:
            raise CallError("the batch is empty")
        messages = tuple(_message(m, i) for i, m in enumerate(doc))
        seen: set[str] = set()
        for m in messages:
            if m.kind == "request" and m.id is not None:
                k = id_key(m.id)
                if k in seen:
                    raise CallError(f"the batch uses the id {k[:40]} twice")
                seen.add(k)
        return Call(messages, batch=True)
    return Call((_message(doc, None),))


def _id(value: Any, where: str) -> Id:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise CallError(f"{where}: the id must be a string or an integer")
    return value


def _message(doc: Any, index: int | None) -> Message:
    where = "the message" if index is None else f"batch entry {index}"
    if not isinstance(doc, dict):
        raise CallError(f"{where} is not a JSON object")
    if doc.get("jsonrpc") != "2.0":
        raise CallError(f'{where} is not JSON-RPC 2.0 (it needs "jsonrpc": "2.0")')
    if "method" not in doc:
        extra = set(doc) - _RESPONSE_KEYS
        if extra:
            raise CallError(f"{where} has members JSON-RPC does not define: "
                            f"{', '.join(sorted(extra))[:80]}")
        if ("result" in doc) == ("error" in doc):
            raise CallError(f"{where} has no method, and is not a response (exactly one of "
                            "result and error)")
        return Message("response", id=_id(doc.get("id"), where))
    extra = set(doc) - _REQUEST_KEYS
    if extra:
        raise CallError(f"{where} has members JSON-RPC does not define: "
                        f"{', '.join(sorted(extra))[:80]}")
    method = doc["method"]
    if not isinstance(method, str) or not method:
        raise CallError(f"{where}: the method must be a non-empty string")
    params = doc.get("params")
    if "params" in doc and not isinstance(params, dict | list):
        raise CallError(f"{where}: params must be an object or an array")
    msg_id = _id(doc["id"], where) if "id" in doc else None
    kind: Literal["request", "notification"] = "request" if "id" in doc else "notification"
    name: str | None = None
    arguments: Mapping[str, Any] | None = None
    size, digest = 0, None
    version: str | None = None
    meta = params.get("_meta") if isinstance(params, dict) else None
    if isinstance(meta, dict) and VERSION_META in meta:
        version = meta[VERSION_META]
        if not isinstance(version, str):
            raise CallError(f"{where}: params._meta {VERSION_META} must be a string")
    member = NAMED.get(method)
    if member is not None:
        if not isinstance(params, dict):
            raise CallError(f"{where}: {method} needs params as an object")
        name = params.get(member)
        if not isinstance(name, str) or not name:
            raise CallError(f"{where}: {method} needs params.{member} as a non-empty string")
    if method == "tools/call":
        assert isinstance(params, dict)
        args = params.get("arguments", {})
        if not isinstance(args, dict):
            raise CallError(f"{where}: tools/call arguments must be an object")
        arguments = args
        raw = json.dumps(args, sort_keys=True, separators=(",", ":")).encode()
        size, digest = len(raw), hashlib.sha256(raw).hexdigest()
    return Message(kind, method, msg_id, name, arguments, size, digest, version)
