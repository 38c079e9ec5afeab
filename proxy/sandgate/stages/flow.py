"""Per-connection and per-flow state the hooks share. Nothing here outlives its connection."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sandgate.audit.export.traceparent import TraceHeaders
from sandgate.decision import Decision, decide
from sandgate.errors import Refused
from sandgate.identity.base import Caller
from sandgate.llm.spend import LlmFlow
from sandgate.netguard import DialTarget
from sandgate.policy.model import Policy, Rule
from sandgate.refusal import Refusal
from sandgate.request import RequestInfo
from sandgate.rpc.jsonrpc import Call, Message
from sandgate.scrub.flowsecrets import Owned
from sandgate.secrets.aws_request import AwsParts
from sandgate.secrets.body import BodyPlan

if TYPE_CHECKING:
    from sandgate.scrub.wsjoin import WsJoin


@dataclass
class Tunnel:
    """What a CONNECT established: every request inside is held to it."""

    caller: Caller
    host: str
    port: int
    rule: Rule | None
    passthrough: bool
    # A CONNECT the policy refuses is still accepted and intercepted (never dialled) so that the
    # inner request gets a refusal body the agent can read: most clients hide CONNECT answers.
    refusal: Refused | None = None
    # The policy the CONNECT was judged by: after a reload, the tunnel is judged again.
    policy: Policy | None = None
    # passthrough: the address checked at CONNECT, the one the tunnel dials
    target: DialTarget | None = None
    # The TLS inside this tunnel: its ClientHello's SNI, and whether it is established. Not
    # the client connection's fields: with TLS to the proxy port those are the outer TLS's.
    sni: str | None = None
    tls: bool = False


@dataclass
class Captured:
    """A connection that arrived on the transparent listener (nftables redirected it)."""

    original: tuple[str, int]  # where the sandbox connected to (SO_ORIGINAL_DST)
    # redirected on this host, so `original` is trustworthy (else DNATed in the sandbox's own
    # namespace: it is the listener itself, and only the name and the scheme's port are judged)
    known: bool = True
    hello_seen: bool = False  # its TLS ClientHello was judged (at most once: the outer TLS)
    # a refusal of the stand-in CONNECT: answered to every request inside the TLS
    refusal: Refused | None = None


@dataclass
class Conn:
    # CONNECT stream -> its tunnel (mitm/guards/tunnels.py: keyed by the stream's Server id; HTTP/2
    # carries several CONNECT streams on one connection)
    tunnels: dict[str | None, Tunnel] = field(default_factory=dict)
    # host -> the address chosen for it on this connection: keep-alive reuses one checked answer
    # (re-checked against each request's rule when reused: s60_dial.pin)
    pinned: dict[tuple[str, int], DialTarget] = field(default_factory=dict)
    # SOCKS5 listener: the username/password it authenticated with, as the Proxy-Authorization
    # value they stand for (mitm/guards/socks5.py), so its CONNECT is identified like an HTTP one
    socks_auth: str | None = field(default=None, repr=False)
    # transparent capture (stages/s15_capture.py): the connection's judgement at its ClientHello
    captured: Captured | None = None

    @property
    def tunnel(self) -> Tunnel | None:
        """The latest tunnel of the connection (for counting; hooks use tunnels.get)."""
        return next(reversed(self.tunnels.values()), None)


@dataclass(frozen=True, slots=True)
class DialApproval:
    """The dial one request was judged for (s60_dial)."""

    address: tuple[str, int]  # as the request names it once pinned: the IP, or the gateway name
    target: DialTarget  # the checked address to connect to
    name: str  # the host name the request was judged for: the upstream's SNI


@dataclass
class CallState:
    """What the response side and the audit need of a judged call (the call stage's:
    sandgate.stages.rpccalls)."""

    policy: Policy
    identity: str
    info: RequestInfo
    call: Call | None = None
    # per message: "allow", "deny", or "batch" (allowed alone, refused with its batch)
    outcomes: list[str] = field(default_factory=list)
    lists: dict[str, str] = field(default_factory=dict)  # id_key -> list method
    removed: int = 0  # list entries filtered out of the answers
    # the MCP protocol version the request's session id was bound to (None: none, or unbound)
    session_version: str | None = None
    init_id: str | None = None  # id_key of an initialize request: its answer names the version
    negotiated: str | None = None  # the protocol version that answer named
    # the session ids of an initialize answer, held back until its version is read
    pending: tuple[bytes, list[str]] | None = None

    def may(self, method: str, name: str) -> bool:
        return decide(self.policy, self.identity, self.info,
                      Call((Message("request", method, 1, name, None),))).allowed

    def fields(self) -> dict[str, Any]:
        """Audit fields: per message method, tool, id, outcome; arguments only by size+hash."""
        if self.call is None:
            return {}
        rpc = []
        for m, outcome in zip(self.call.messages, self.outcomes, strict=False):
            entry: dict[str, Any] = {"kind": m.kind, "method": m.method, "id": m.id,
                                     "decision": outcome}
            if m.name is not None:
                entry["tool" if m.method == "tools/call" else "name"] = m.name
            if m.args_sha256 is not None:
                entry["args_bytes"] = m.args_bytes
                entry["args_sha256"] = m.args_sha256
            rpc.append(entry)
        out: dict[str, Any] = {"rpc": rpc}
        if self.removed:
            out["rpc_filtered"] = self.removed
        return out


@dataclass
class FlowRecord:
    """Everything the audit event of one flow needs, filled as the flow advances."""

    started: float = field(default_factory=time.monotonic)
    caller: Caller | None = None
    info: RequestInfo | None = None
    decision: Decision | None = None
    refusal: Refusal | None = None
    secrets: list[str] = field(default_factory=list)  # "name@version", never values
    # the values injected into this flow: always scrubbed from its response (flowsecrets)
    owned: Owned = field(default_factory=Owned, repr=False)
    dialed: str | None = None
    # what this request may dial: the address as the request now names it, the checked address
    # and the name TLS verifies (s60_dial.pin); server_connect reads it from the dial's own flow
    # (mitm/guards/dialorigin.py), never from per-connection state another tunnel could overwrite
    dial: DialApproval | None = None
    exfiltration: list[str] = field(default_factory=list)
    redactions: int = 0
    bytes_out: int = 0
    audited: bool = False
    scrub_whole: bool = False  # a small body of known length: buffered, scrubbed at once
    websocket_closed: bool = False  # a message carried a credential: drop everything after it
    # the upstream's WebSocket text deltas, scrubbed of what the client joins (scrub/wsjoin.py)
    ws_join: WsJoin | None = None
    # The policy this flow is judged by, read once at its first hook (a reload mid-flow does not
    # change it), and its placeholder map.
    policy: Policy | None = None
    placeholders: dict[str, str] = field(default_factory=dict)
    # mode: report: the rules refused (decision.code says why); forwarded without credentials
    reported: bool = False
    # the gateway prefix the request arrived under (gateway listener), None for proxied ones
    gateway: str | None = None
    # where the body's placeholders are (a `substitute_body` rule; secrets/body.py), found when
    # the body is judged and filled with values at injection
    body_plan: BodyPlan | None = None
    # how each credential went in, for the audit ("openai@3: body json: 1 value(s)"), no values
    injected: list[str] = field(default_factory=list)
    # a rule with mcp:/jsonrpc: matched: the call judged and its list answers (stages/rpccalls.py)
    call: CallState | None = None
    # a signing rule allowed it: what it judged of the headers and parameters the signature
    # covers (stages/s36_sigv4.py); s55_sign signs nothing without it
    aws: AwsParts | None = None
    # an `action: ask` rule's request went on: how ("approved (ap_...) by alice", a remembered
    # grant); the approval events of the audit say the rest (sandgate.approvals)
    approval: str | None = None
    # the sandbox's traceparent/tracestate, taken off the request before forwarding (s40), and
    # instants of the request's parts (sandgate.audit.export.marks): for its span (otel.py)
    trace: TraceHeaders | None = None
    marks: dict[str, int] = field(default_factory=dict)
    # the upstream connection this request may reuse: whose, from where, to what (s60_dial;
    # mitm/speedups/upstreampool.py says why that key is safe). None: dial as usual, never parked
    reuse: tuple[str, str | None, str, tuple[str, int] | None, str, int, str] | None = None
    # an LLM API call (stages/s37_llm.py): what it asked, reserved and spent (sandgate.llm.spend)
    llm: LlmFlow | None = None

    @property
    def refused(self) -> bool:
        return self.refusal is not None


METADATA_KEY = "sandgate"
