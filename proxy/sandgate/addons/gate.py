"""The Sandgate addon: mitmproxy's hooks, in the order a request meets them.

CONNECT: identify, decide on host and port. Request: identify (or take the tunnel's caller),
parse, decide, check for leaks, fetch secrets, inject, pin the dialled address. Response: scrub
headers and stream the body through the scrubber. Always: one audit event per flow.

Every hook is wrapped by `guarded`: a `Refused` raised anywhere below becomes the sandbox's
refusal here and nowhere else, and any other exception refuses too (internal_error). mitmproxy
itself only logs a hook's exception and lets the flow continue, which for a security proxy would
mean forwarding a request nobody judged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mitmproxy import connection, ctx, dns, http, tcp, tls, udp
from mitmproxy.net.dns import response_codes
from mitmproxy.net.http import url
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.mode_specs import ReverseMode

from sandgate import audit as A
from sandgate.addons import relay, wirelimits
from sandgate.addons.calls import (
    Sessions,
    answer_call,
    filter_whole,
    judge_call,
    response_headers,
    wrap_stream,
)
from sandgate.addons.forward import (
    check_authority,
    check_upgrade,
    inspectable_body,
    is_websocket_upgrade,
    prepare,
)
from sandgate.addons.socks5 import (
    REP_NOT_ALLOWED,
    Socks5ConnectData,
    basic_credentials,
    connect_flow,
    is_socks5,
    source_allowed,
)
from sandgate.addons.state import METADATA_KEY, Conn, FlowRecord, Tunnel
from sandgate.addons.stream import (
    ResponseScrubber,
    clean_head,
    scrub_headers,
    scrub_whole,
    scrub_whole_candidate,
)
from sandgate.decision import decide, decide_connect, reported
from sandgate.errors import BadRequest, Code, IdentityError, LimitExceeded, Refused
from sandgate.gateway import route, take_token
from sandgate.identity.base import Caller
from sandgate.identity.resolve import Identifier
from sandgate.inject import Leak, apply, find_leaks, find_leaks_in, own_forms
from sandgate.limits import Limiter, LimitsConfig
from sandgate.netguard import (
    DialTarget,
    IPAddress,
    IPNetwork,
    choose_address,
    may_dial,
    resolve,
)
from sandgate.policy.hosts import normalise_host
from sandgate.policy.model import Policy, Rule
from sandgate.refusal import Refusal
from sandgate.request import RequestInfo, check_head, check_tunnel, parse_proxied, same_host
from sandgate.scrub import SecretSet
from sandgate.secrets.scope import resolve as resolve_secret_path
from sandgate.secrets.vault import SecretBroker

log = logging.getLogger("sandgate")

# Refusals of a CONNECT that are answered inside the tunnel instead (see Tunnel.refusal).
_DEFERRABLE = frozenset({Code.NO_RULE, Code.DENIED_BY_RULE, Code.UNKNOWN_IDENTITY})

F = TypeVar("F", bound=Callable[..., Awaitable[None]])


@dataclass
class GateConfig:
    policy: Policy
    broker: SecretBroker
    identifier: Identifier
    audit: A.AuditLog
    resolve_overrides: dict[str, str] = field(default_factory=dict)
    self_addresses: tuple[tuple[IPAddress, int], ...] = ()
    max_request_body: int = 32 * 1024 * 1024
    # secret-like name -> decoy value (`sandgate run --canary`): refused in requests, scrubbed
    canaries: dict[str, str] = field(default_factory=dict)
    # forward even while the audit log cannot be written (--audit-best-effort); off: fail closed
    audit_best_effort: bool = False
    # rates, budgets, connection counts and head limits (sandgate.limits, `sandgate run` flags)
    limiter: Limiter = field(default_factory=lambda: Limiter(LimitsConfig()))
    # --socks5-allow: the source ranges the SOCKS5 listener serves (empty: every source)
    socks5_allow: tuple[IPNetwork, ...] = ()
    # the gateway listener takes TLS only (`--gateway-tls-name`)
    gateway_tls: bool = False


def guarded(fn: F) -> F:
    """Run a hook; a `Refused` becomes the refusal, any other exception refuses as well."""

    @functools.wraps(fn)
    async def wrapper(self: Gate, obj: Any) -> None:
        try:
            await fn(self, obj)
        except Refused as e:
            self._refused(obj, e)
        except Exception:
            log.exception("sandgate: %s hook failed; refusing", fn.__name__)
            self._fail(obj)

    return wrapper  # type: ignore[return-value]


class Gate:
    def __init__(self, config: GateConfig) -> None:
        self.cfg = config
        self.conns: dict[str, Conn] = {}
        self._placeholders = dict(config.policy.placeholders)
        self._secret_set = SecretSet({})
        self._secret_generation = -1
        self.sessions = Sessions()  # MCP session ids -> the identity that opened each

    @property
    def policy(self) -> Policy:
        return self.cfg.policy

    def set_policy(self, policy: Policy, canaries: dict[str, str] | None = None) -> None:
        """Swap in a reloaded (fully built and validated) policy. Flows already judged keep the
        policy they started with (FlowRecord.policy); every new flow, and every new request in
        an open tunnel, is judged by this one."""
        placeholders = dict(policy.placeholders)
        if canaries is not None:
            self.cfg.canaries = canaries
        self._placeholders = placeholders
        self.cfg.policy = policy
        self._secret_generation = -1  # own_forms depend on the policy: rebuild the automaton

    def _flow_policy(self, rec: FlowRecord) -> Policy:
        """The one policy a flow is judged by, read at its first hook."""
        if rec.policy is None:
            rec.policy = self.cfg.policy
            rec.placeholders = self._placeholders
        return rec.policy

    def secrets(self) -> SecretSet:
        """Every cached secret value and its encodings, compiled once per change of the cache."""
        broker = self.cfg.broker
        if broker.generation != self._secret_generation:
            generation = broker.generation
            # Every value of every sandbox: a sandbox must not receive another's value either.
            pairs = [*self.cfg.canaries.items(), *broker.cached_pairs()]
            extra: dict[str, list[bytes]] = {}
            for view in broker.value_views():  # one caller's values together (a Basic pair)
                for name, forms in own_forms(self.policy, view).items():
                    extra.setdefault(name, []).extend(forms)
            self._secret_set = SecretSet(pairs, extra)
            self._secret_generation = generation
        return self._secret_set

    # ---------------------------------------------------------------- connections

    def _conn(self, client: connection.Client) -> Conn:
        c = self.conns.get(client.id)
        if c is None:
            c = self.conns[client.id] = Conn()
        return c

    def _admit_client(self, client: connection.Client) -> bool:
        """Past --max-connections a new client connection is closed at once (and audited)."""
        try:
            if self.cfg.limiter.connected(client.id):
                return True
            reason = (f"Sandgate has {self.cfg.limiter.config.max_connections} client "
                      "connections open (--max-connections)")
        except Exception:
            log.exception("sandgate: client_connected failed; closing")
            reason = "Sandgate hit an internal error"
        client.error = f"sandgate: {reason}"
        self._audit_limit(Code.TOO_MANY_CONNECTIONS, reason, client)
        return False

    def client_disconnected(self, client: connection.Client) -> None:
        self.conns.pop(client.id, None)
        self.cfg.limiter.disconnected(client.id)
        relay.forget(client)

    def _audit_limit(self, code: Code, reason: str, client: connection.Client) -> None:
        """A limit met where there is no flow (a connection, a head that never ended)."""
        peer = client.peername
        try:
            self.cfg.audit.emit("limit", code=str(code), reason=reason,
                                client=f"{peer[0]}:{peer[1]}" if peer else None)
        except Exception:
            log.exception("sandgate: audit failed")

    def _count_connection(self, flow: http.HTTPFlow, caller: Caller, policy: Policy) -> None:
        """The connection counts for its identity from its first CONNECT or request on."""
        ident = policy.identities.get(caller.identity)
        self.cfg.limiter.identified(flow.client_conn.id, caller.identity,
                                    ident.limits if ident is not None else None)

    def _check_head_size(self, req: http.Request) -> None:
        """Bounded before trusted: the head's size and header count, before anything else.
        (HTTP/1 heads past the byte limit never get this far: sandgate.addons.wirelimits.)"""
        lim = self.cfg.limiter.config
        count = len(req.headers.fields)
        if count > lim.max_headers:
            raise LimitExceeded(Code.HEADERS_TOO_LARGE, f"the request has {count} header "
                                f"fields; at most {lim.max_headers} are accepted",
                                hint="send fewer headers")
        size = wirelimits.head_bytes(req)
        if size > lim.max_header_bytes:
            raise LimitExceeded(Code.HEADERS_TOO_LARGE, f"the request head is {size} bytes; "
                                f"at most {lim.max_header_bytes} are accepted",
                                hint="send smaller headers (cookies, tokens)")

    # ---------------------------------------------------------------- CONNECT

    @guarded
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        req = flow.request
        self._check_head_size(req)
        caller = rec.caller = self._identify(flow, req.headers.get("proxy-authorization"))
        self._count_connection(flow, caller, self._flow_policy(rec))
        try:
            host = normalise_host(req.host)
        except ValueError as e:
            raise BadRequest(Code.BAD_REQUEST, f"bad CONNECT host: {e}") from None
        rec.info = RequestInfo("https", host, req.port, "CONNECT", "")
        policy = self._flow_policy(rec)
        d = rec.decision = decide_connect(policy, caller.identity, host, req.port)
        tunnel = Tunnel(caller=caller, host=host, port=req.port, rule=d.rule,
                        passthrough=d.allowed and d.rule is not None and d.rule.passthrough,
                        policy=policy)
        if tunnel.passthrough:
            self._check_audit()  # a passthrough tunnel is forwarded at CONNECT, unseen after
        if not d.allowed:
            if d.code not in _DEFERRABLE:
                raise d.refused()
            tunnel.rule = None
            if reported(policy, caller.identity, d):
                rec.reported = True  # intercepted; each request inside is judged (and reported)
            else:
                tunnel.refusal = d.refused()
                rec.refusal = self._refusal(flow, tunnel.refusal)
        self._conn(flow.client_conn).tunnel = tunnel
        self._audit(flow, event="connect")

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        self._audit(flow, event="connect")

    # ---------------------------------------------------------------- SOCKS5 (addons/socks5.py)
    # Each SOCKS5 step is judged on a CONNECT flow built from it, by the HTTP listener's code:
    # the same identity check, decision, tunnel state, refusal and `connect` audit event.

    def client_connected(self, client: connection.Client) -> None:
        """--socks5-allow: a SOCKS5 client from another source is dropped before one byte of
        its handshake is read (audited as auth_invalid: no sandbox is served from there).
        Any client past --max-connections is closed at once."""
        if not self._admit_client(client):
            return
        try:
            if not is_socks5(client) or source_allowed(client.peername[0],
                                                       self.cfg.socks5_allow):
                return
            client.error = "sandgate: source address outside --socks5-allow"
            self._socks_refused(connect_flow(client, "", 0, None), IdentityError(
                Code.AUTH_INVALID, f"the SOCKS5 listener does not serve address "
                f"{client.peername[0]} (outside --socks5-allow)"))
        except Exception:
            log.exception("sandgate: client_connected failed; dropping the client")
            client.error = "sandgate: internal error"

    def socks5_auth(self, data: modes.Socks5AuthData) -> None:
        """The SOCKS5 username/password are the identity and the token of Proxy-Authorization;
        no credentials is auth_required even where an address source would vouch."""
        data.valid = False
        flow = connect_flow(data.client_conn, "", 0, None)
        try:
            header = basic_credentials(data.username, data.password)
            if header is None:
                raise IdentityError(Code.AUTH_REQUIRED, "proxy authentication required: the "
                                    "SOCKS5 listener needs username/password authentication "
                                    "with the identity as user and a proxy token as password")
            _record(flow).caller = self._identify(flow, header)
            self._conn(data.client_conn).socks_auth = header
            data.valid = True
        except Refused as e:
            self._socks_refused(flow, e)
        except Exception:
            log.exception("sandgate: socks5_auth failed; refusing")
            self._socks_refused(flow, Refused(Code.INTERNAL_ERROR, "Sandgate hit an internal "
                                              "error; nothing was sent"))

    async def socks5_connect(self, data: Socks5ConnectData) -> None:
        """A SOCKS5 CONNECT is an HTTP CONNECT: granted unless http_connect answered it."""
        data.reply = REP_NOT_ALLOWED
        flow = connect_flow(data.client_conn, data.host, data.port,
                            self._conn(data.client_conn).socks_auth)
        await self.http_connect(flow)
        if flow.response is None and _record(flow).caller is not None:
            data.reply = None  # granted (a deferred policy refusal is answered inside)
        else:
            self._audit(flow, event="connect")

    def _socks_refused(self, flow: http.HTTPFlow, error: Refused) -> None:
        try:
            self._refused(flow, error)
        finally:
            self._audit(flow, event="connect")

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        try:
            tunnel = self._conn(data.context.client).tunnel
            if tunnel is None or not tunnel.passthrough:
                return
            sni = data.client_hello.sni
            # Pass through only what the CONNECT named; otherwise intercept and let the request
            # hook refuse the disagreement with a readable answer.
            if sni is not None and same_host(sni, tunnel.host):
                data.ignore_connection = True
                relay.verified(data.context)  # relayed lean once the approved dial is up
        except Exception:
            log.exception("sandgate: tls_clienthello failed; intercepting instead")

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        # Raw bytes inside a CONNECT that no passthrough rule allows: nothing to judge, nothing
        # relayed (mitmproxy ignores kill() in tcp_start; server_connect refuses the dial too).
        try:
            tunnel = self._conn(flow.client_conn).tunnel
            if tunnel is not None and tunnel.passthrough:
                return
        except Exception:
            log.exception("sandgate: tcp_message failed; dropping")
        _drop_raw(flow)

    def udp_message(self, flow: udp.UDPFlow) -> None:
        _drop_raw(flow)

    def dns_request(self, flow: dns.DNSFlow) -> None:
        # A CONNECT to port 53 carrying raw DNS would be resolved by mitmproxy itself: answer
        # REFUSED; should even that fail, end the flow (an exception here would let it resolve).
        try:
            flow.response = flow.request.fail(response_codes.REFUSED)
        except Exception:
            log.exception("sandgate: dns_request failed; killing")
            if flow.killable:
                flow.kill()

    # ---------------------------------------------------------------- dialling

    @guarded
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """The one place every upstream dial passes: only approved, checked addresses go."""
        conn = self._conn(data.client)
        server = data.server
        address = server.address
        if address is None:
            server.error = "sandgate: no address"
            return
        key = (str(address[0]), int(address[1]))
        named = conn.by_name.get(key)
        if named is not None:  # a gateway request: dial the checked address, verify the name
            server.address = named.address
            server.sni = key[0]
            return
        if key in conn.approved:
            # We dial the checked IP; TLS must still verify the name the request was judged for.
            server.sni = conn.approved[key]
            return
        tunnel = conn.tunnel
        if tunnel is not None and tunnel.passthrough and tunnel.rule is not None:
            if same_host(str(address[0]), tunnel.host) and address[1] == tunnel.port:
                target = await self._choose(tunnel.host, tunnel.port, tunnel.rule.private_cidrs)
                server.address = target.address
                wirelimits.exempt(server)  # raw bytes: the idle timeout applies, not the read one
                return
        server.error = "sandgate: connection was not approved"

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        """A gateway's upstream connection is known by the name it was verified for (see
        `request`), so that mitmproxy reuses it only for requests to that same name."""
        try:
            conn = self.conns.get(data.client.id)
            server = data.server
            if conn is None or server.sni is None or server.address is None:
                return
            name = (server.sni, int(server.address[1]))
            named = conn.by_name.get(name)
            if named is not None and named.address == tuple(server.address):
                server.address = name
        except Exception:  # not a decision: without it the connection is simply not reused
            log.exception("sandgate: server_connected failed")

    async def _choose(self, host: str, port: int, private_cidrs: Iterable[IPNetwork],
                      only_public: bool = False) -> DialTarget:
        ips = await resolve(host, port, self.cfg.resolve_overrides)
        return choose_address(host, port, ips, private_cidrs, self.cfg.self_addresses,
                              only_public)

    # ---------------------------------------------------------------- requests

    @guarded
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Judge the head before any body is read: nothing unbounded before identity is known."""
        if flow.error is not None:
            return  # mitmproxy is refusing it already (invalid head, body over the limit)
        try:
            self._judge_head(flow)
        except Refused as e:
            self._refused(flow, e)
            if _body_expected(flow.request) > _SMALL_BODY:
                flow.kill()  # do not read (and buffer) a large body only to refuse it

    def _check_audit(self) -> None:
        """Nothing is forwarded that cannot be audited (unless run with --audit-best-effort)."""
        if not self.cfg.audit.healthy and not self.cfg.audit_best_effort:
            raise Refused(Code.AUDIT_UNAVAILABLE, "Sandgate cannot write its audit log; nothing "
                          "is forwarded until it can", hint="retry later")

    def _judge_head(self, flow: http.HTTPFlow) -> None:
        self._check_audit()
        rec = _record(flow)
        req = flow.request
        self._check_head_size(req)
        policy = self._flow_policy(rec)
        if via_gateway(flow):
            info = self._gateway_head(flow, rec, policy)
        else:
            auth = req.headers.pop("proxy-authorization", None)
            tunnel = self._conn(flow.client_conn).tunnel
            if tunnel is None and is_socks5(flow.client_conn):
                raise IdentityError(Code.AUTH_REQUIRED, "no SOCKS5 CONNECT was granted")
            rec.caller = tunnel.caller if tunnel is not None else self._identify(flow, auth)
            _check_wire(req)
            if tunnel is not None and tunnel.policy is not policy:
                self._rejudge_tunnel(tunnel, policy)
            info = rec.info = self._parse(flow, tunnel)
        caller = rec.caller
        assert caller is not None
        self._count_connection(flow, caller, policy)  # once per connection
        ident = policy.identities.get(caller.identity)
        if ident is not None:  # an unknown identity is refused by decide()
            self.cfg.limiter.admit(caller.identity, ident.limits)
        d = rec.decision = decide(policy, caller.identity, info)
        if not d.allowed:
            if not reported(policy, caller.identity, d):
                raise d.refused()
            rec.reported = True  # forwarded without credentials; audited as `report`
        check_authority(req, info)
        check_upgrade(req)
        declared = _declared_length(req)
        if declared is not None:  # a chunked body is measured as it is received (request)
            self._check_size(declared, self._body_limit(rec))

    def _gateway_head(self, flow: http.HTTPFlow, rec: FlowRecord, policy: Policy) -> RequestInfo:
        """A request on the gateway listener, turned into the proxied request it stands for:
        the upstream and the path after the prefix, the identity from the token header (which
        is removed). From here on it is judged and forwarded exactly as a proxied request."""
        req = flow.request
        if self.cfg.gateway_tls and not flow.client_conn.tls_established:
            raise BadRequest(Code.NOT_TLS, "this gateway takes TLS only: use https:// in the "
                             "SDK's base URL")
        _check_wire(req)
        if req.authority and not (req.is_http2 or req.is_http3):
            raise BadRequest(Code.BAD_REQUEST, "the gateway takes origin-form targets only "
                             "(a path such as /anthropic/v1/messages), not absolute URLs")
        routed = route(policy.gateways, req.method, req.path)
        gw = routed.gateway
        rec.gateway = gw.prefix
        rec.info = routed.info  # refusals from here on name the upstream request
        client_ip = flow.client_conn.peername[0]
        identifier = self.cfg.identifier
        token = take_token(req.headers, gw, identifier.address_known(client_ip))
        rec.caller = identifier.identify_token(token, client_ip)
        # Re-target: from now on mitmproxy, the hooks and the audit see the upstream request.
        req.data.scheme = b"https"
        req.data.host = gw.host
        req.data.port = gw.port
        req.data.path = routed.path.encode("latin-1", "surrogateescape")
        req.host_header = url.hostport("https", gw.host, gw.port)
        return routed.info

    def _rejudge_tunnel(self, tunnel: Tunnel, policy: Policy) -> None:
        """A reload happened since the CONNECT: its (deferred) refusal follows the new policy.
        Requests inside are judged by the new policy anyway; passthrough is fixed at CONNECT."""
        tunnel.policy = policy
        if tunnel.passthrough:
            return
        d = decide_connect(policy, tunnel.caller.identity, tunnel.host, tunnel.port)
        tunnel.refusal = None
        if not d.allowed and not reported(policy, tunnel.caller.identity, d):
            tunnel.refusal = d.refused()

    @guarded
    async def request(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        if rec.refused:
            return  # answered at requestheaders
        req = flow.request
        if rec.decision is None:
            self._judge_head(flow)  # never forward what requestheaders did not judge
        info, d = rec.info, rec.decision
        policy = self._flow_policy(rec)
        assert info is not None and d is not None
        refused = judge_call(rec, req, policy, self.sessions)  # the body's JSON-RPC calls
        if refused is not None:
            return answer_call(flow, rec, self._refusal(flow, refused))
        d = rec.decision if rec.decision is not None else d
        # report mode: no rule allowed it, so nothing is bound, injected or swapped, and the
        # address is checked without any private_cidrs.
        rule = None if rec.reported else d.rule
        assert rule is not None or rec.reported
        bound = rule.secrets if rule is not None else frozenset()
        private_cidrs = rule.private_cidrs if rule is not None else ()
        # The body is complete now: the head once more (this is the authoritative point) and the
        # body's size as received (a chunked body has no length up front).
        _check_wire(req)
        limit = self._body_limit(rec)
        self._check_size(len(req.raw_content or b""), limit)
        body = inspectable_body(req, limit)
        leaks = find_leaks(req, body, rec.placeholders, self.secrets(), bound)
        if leaks:
            rec.exfiltration = sorted({f"{lk.secret}:{lk.kind}:{lk.where}" for lk in leaks})
            raise _exfiltration(leaks, rule)

        websocket = is_websocket_upgrade(req)
        prepare(req, websocket)
        if rule is not None and rule.secrets:
            if info.scheme != "https" or ctx.options.ssl_insecure:
                raise Refused(Code.UNSAFE_INJECTION,
                              "credentials are injected only over verified TLS to the upstream")
            caller = rec.caller
            assert caller is not None
            for name in sorted(rule.secrets):  # refuse a sandbox-less caller before any read
                resolve_secret_path(policy.secrets[name], caller.identity, caller.sandbox)
            values: dict[str, str] = {}
            versions: list[str] = []
            for name in sorted(rule.secrets):
                sv = await self.cfg.broker.get(name, caller)
                values[name] = sv.value
                if sv.username is not None:
                    values[f"{name}.username"] = sv.username
                versions.append(f"{name}@{sv.version}" if sv.version else name)
            # counted only now that the secrets are there to inject (or 429, nothing spent)
            self.cfg.limiter.spend((n, policy.secrets[n].budget) for n in sorted(rule.secrets))
            rec.secrets += versions
            apply(rule, req, values, {n: policy.secrets[n].placeholder for n in rule.secrets})

        conn = self._conn(flow.client_conn)
        target = conn.pinned.get((info.host, info.port))
        # A `public: true` rule resolves afresh: a pin chosen for another rule may have skipped
        # a non-public address that this rule must refuse the host for.
        only_public = rule is not None and rule.public
        if target is None or only_public or not may_dial(target.ip, private_cidrs):
            target = await self._choose(info.host, info.port, private_cidrs, only_public)
            conn.pinned[(info.host, info.port)] = target
        rec.dialed = f"{target.ip}:{target.port}"
        if via_gateway(flow):
            # One gateway connection serves several upstreams. mitmproxy reuses an upstream
            # connection for any request to the same address, so two names sharing an IP would
            # share a TLS connection verified for one of them: the dial is keyed by name, and
            # server_connect dials the checked address with that name as SNI.
            conn.by_name[(info.host, info.port)] = target
        else:
            conn.approved[(str(target.ip), target.port)] = info.host
            # Dial exactly the checked address; the Host header and SNI keep the name.
            req.data.host = str(target.ip)
        # Scrubbing needs plain bytes: ask the upstream not to compress.
        req.headers["accept-encoding"] = "identity"

    def _body_limit(self, rec: FlowRecord) -> int:
        """The request body limit: --max-request-body, or the allowing rule's
        max_request_bytes when smaller (report mode: no rule allowed, so the proxy's)."""
        d = rec.decision
        rule = d.rule if d is not None and d.allowed and not rec.reported else None
        if rule is not None and rule.max_request_bytes is not None:
            return min(self.cfg.max_request_body, rule.max_request_bytes)
        return self.cfg.max_request_body

    def _check_size(self, size: int, limit: int) -> None:
        if size > limit:
            which = ("this proxy accepts" if limit == self.cfg.max_request_body
                     else "the rule allowing it accepts (max_request_bytes)")
            raise BadRequest(Code.TOO_LARGE, f"the request body is larger than {which} "
                             f"({limit} bytes)")

    def _identify(self, flow: http.HTTPFlow, proxy_authorization: str | None) -> Caller:
        return self.cfg.identifier.identify(proxy_authorization, flow.client_conn.peername[0])

    def _parse(self, flow: http.HTTPFlow, tunnel: Tunnel | None) -> RequestInfo:
        """The request as the policy sees it; refuses one that disagrees with its tunnel."""
        req = flow.request
        try:
            info = parse_proxied(req.scheme, req.host, req.port, req.method, req.path,
                                 req.host_header)
            _record(flow).info = info
            if tunnel is not None:
                check_tunnel(info, tunnel.host, tunnel.port, flow.client_conn.tls_established,
                             flow.client_conn.sni)
            elif req.scheme == "https":
                # https without a CONNECT (e.g. a TLS client talking to the proxy port directly)
                raise BadRequest(Code.BAD_REQUEST, "https requests must arrive through CONNECT")
        except BadRequest:
            if tunnel is not None and tunnel.refusal is not None:
                raise tunnel.refusal from None  # the CONNECT's refusal comes first
            raise
        if tunnel is not None and tunnel.refusal is not None:
            raise tunnel.refusal
        return info

    # ---------------------------------------------------------------- responses

    @guarded
    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        resp = flow.response
        if resp is None or rec.refused:
            return
        response_headers(rec, resp, self.sessions)
        if resp.status_code == 101 and not (
                is_websocket_upgrade(flow.request)
                and resp.headers.get("upgrade", "").strip().lower() == "websocket"):
            self._drop_response(flow, Refused(
                Code.UPSTREAM_ERROR, "the upstream switched to a protocol other than the "
                "WebSocket that was asked for"))
            return
        secrets = self.secrets()
        rec.redactions += clean_head(resp, secrets)
        if flow.request.method == "HEAD" or resp.status_code in (204, 304) or (
            resp.status_code < 200
        ):
            return  # no body: nothing to stream or reframe
        if scrub_whole_candidate(resp, secrets):
            rec.scrub_whole = True  # small and of known length: buffered, scrubbed in response
            return
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        scrubber = ResponseScrubber(secrets, encoding, resp, flow.request.http_version)
        if scrubber.refuse_reason:
            self._drop_response(flow, Refused(Code.UPSTREAM_ERROR, scrubber.refuse_reason))
            return

        def stream(chunk: bytes) -> bytes | list[bytes]:
            out = scrubber(chunk)
            rec.redactions = scrubber.replacements
            rec.bytes_out += sum(len(c) for c in out)
            return out

        resp.stream = wrap_stream(rec, flow, stream)  # MCP list answers filtered

    def response(self, flow: http.HTTPFlow) -> None:
        try:
            resp = flow.response
            rec = _record(flow)
            if resp is not None and rec.scrub_whole and not rec.refused:
                rec.redactions += scrub_whole(resp, self.secrets())
                filter_whole(rec, resp)
                rec.bytes_out = len(resp.raw_content or b"")
            if resp is not None and resp.trailers and not rec.refused:
                if flow.client_conn.alpn == b"h2":
                    _record(flow).redactions += scrub_headers(resp.trailers, self.secrets())
                else:  # HTTP/1 clients get no trailers (mitmproxy cannot send them anyway)
                    resp.trailers = None
        except Exception:
            log.exception("sandgate: response hook failed; killing")
            _record(flow).refusal = Refusal(Code.UPSTREAM_ERROR, "the upstream's response "
                                            "could not be scrubbed; nothing of it was sent")
            if flow.killable:
                flow.kill()
        self._audit(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        if (flow.error is not None and wirelimits.TIMEOUT_MARK in flow.error.msg
                and rec.refusal is None):
            rec.refusal = Refusal(Code.UPSTREAM_TIMEOUT, "the upstream did not answer in time",
                                  identity=rec.caller.identity if rec.caller else None,
                                  target=rec.info.target if rec.info is not None else None)
        self._audit(flow)

    # ---------------------------------------------------------------- WebSocket

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Scrub what the upstream sends; drop, and stop the stream, on anything leaving that
        carries a credential. Messages arrive whole (mitmproxy reassembles fragments)."""
        assert flow.websocket is not None
        message = flow.websocket.messages[-1]
        rec = _record(flow)
        try:
            if rec.websocket_closed:
                message.drop()
                return
            secrets = self.secrets()
            if not message.from_client:
                clean, n = secrets.scrub(message.content)
                if n:
                    message.content = clean
                    rec.redactions += n
                return
            rule = rec.decision.rule if rec.decision is not None and not rec.reported else None
            bound = rule.secrets if rule is not None else frozenset()
            placeholders = rec.placeholders if rec.policy is not None else self._placeholders
            leaks = find_leaks_in(message.content, "websocket", placeholders, secrets, bound)
            if leaks:
                message.drop()
                rec.websocket_closed = True
                rec.exfiltration = sorted({f"{lk.secret}:{lk.kind}:{lk.where}" for lk in leaks})
                self._audit_event(flow, "websocket", _exfiltration(leaks, rule))
        except Exception:
            log.exception("sandgate: websocket_message failed; dropping the stream")
            rec.websocket_closed = True
            message.drop()

    # ---------------------------------------------------------------- refusals and audit

    def _refused(self, obj: Any, error: Refused) -> None:
        """The one place a raised refusal becomes what the sandbox (or the dialler) sees."""
        if isinstance(obj, http.HTTPFlow):
            self._refuse(obj, self._refusal(obj, error))
        elif isinstance(obj, server_hooks.ServerConnectionHookData):
            obj.server.error = f"sandgate: {error.code}: {error.reason}"
        else:
            self._fail(obj)

    def _refusal(self, flow: http.HTTPFlow, error: Refused) -> Refusal:
        rec = _record(flow)
        target = rec.info.target if rec.info is not None and flow.request.method != "CONNECT" \
            else _target(flow.request)
        gateway = via_gateway(flow)
        if gateway and rec.info is None:
            target = A.redact_path(flow.request.path)  # no gateway matched: its own path
        identity = rec.caller.identity if rec.caller is not None else None
        refusal = Refusal.from_error(error, identity=identity, target=target, gateway=gateway)
        secrets = self.secrets()
        if secrets.empty:
            return refusal
        # The reason may quote the request, and the request may quote a value.
        return dataclasses.replace(
            refusal,
            reason=secrets.scrub_text(refusal.reason)[0],
            target=secrets.scrub_text(refusal.target)[0] if refusal.target else None,
            hint=secrets.scrub_text(refusal.hint)[0] if refusal.hint else None,
        )

    def _drop_response(self, flow: http.HTTPFlow, error: Refused) -> None:
        """An upstream answer that cannot be forwarded: nothing of it reaches the sandbox."""
        _record(flow).refusal = self._refusal(flow, error)
        flow.kill()

    def _refuse(self, flow: http.HTTPFlow, refusal: Refusal) -> None:
        _record(flow).refusal = refusal
        flow.response = http.Response.make(refusal.status, refusal.body(), refusal.headers())
        if refusal.status == 407 or flow.request.method == "CONNECT" or (
                refusal.code == Code.TOO_MANY_CONNECTIONS):
            flow.response.headers["connection"] = "close"

    def _fail(self, obj: Any) -> None:
        if isinstance(obj, http.HTTPFlow):
            if obj.response is None or not _record(obj).refused:
                try:
                    self._refuse(obj, Refusal(Code.INTERNAL_ERROR,
                                              "Sandgate hit an internal error; nothing was sent",
                                              target=_target(obj.request)))
                except Exception:
                    obj.kill()
            if obj.live and obj.killable:
                obj.kill()
            return
        if isinstance(obj, server_hooks.ServerConnectionHookData):
            obj.server.error = "sandgate: internal error"
            return
        kill = getattr(obj, "kill", None)
        if callable(kill) and getattr(obj, "killable", False):
            kill()

    def _audit_event(self, flow: http.HTTPFlow, event: str, error: Refused) -> None:
        """An event of its own (after the flow's request event was written)."""
        rec = _record(flow)
        refusal = self._refusal(flow, error)
        saved, rec.refusal = rec.refusal, refusal
        try:
            self.cfg.audit.emit(event, **A.scrub_fields(A.flow_fields(flow, rec), self.secrets()))
        except Exception:
            log.exception("sandgate: audit failed")
        finally:
            rec.refusal = saved

    def _audit(self, flow: http.HTTPFlow, event: str = "request") -> None:
        rec = _record(flow)
        if rec.audited:
            return
        rec.audited = True
        try:
            self.cfg.audit.emit(event, **A.scrub_fields(A.flow_fields(flow, rec), self.secrets()))
        except Exception:
            log.exception("sandgate: audit failed")


def via_gateway(flow: http.HTTPFlow) -> bool:
    """Did the flow arrive on the gateway listener (the only reverse-mode listener)?"""
    return isinstance(flow.client_conn.proxy_mode, ReverseMode)


def _record(flow: http.HTTPFlow) -> FlowRecord:
    rec = flow.metadata.get(METADATA_KEY)
    if rec is None:
        rec = flow.metadata[METADATA_KEY] = FlowRecord()
    assert isinstance(rec, FlowRecord)
    return rec


_SMALL_BODY = 64 * 1024


def _drop_raw(flow: tcp.TCPFlow | udp.UDPFlow) -> None:
    """Relay nothing of a raw message (mitmproxy ignores kill() in tcp_start/udp_start)."""
    flow.messages[-1].content = b""
    if flow.killable:
        flow.kill()  # type: ignore[no-untyped-call]  # mitmproxy's Flow.kill is unannotated


def _check_wire(req: http.Request) -> None:
    check_head(req.data.method.decode("latin-1"), req.data.path.decode("latin-1"),
               req.headers.fields)


def _declared_length(req: http.Request) -> int | None:
    """The Content-Length the head declares, or None (chunked, or no body announced)."""
    if "transfer-encoding" in req.headers:
        return None
    try:
        return int(req.headers.get("content-length", "0") or 0)
    except ValueError:
        return None  # mitmproxy refuses a malformed length itself (validate_inbound_headers)


def _body_expected(req: http.Request) -> int:
    """How many body bytes the head announces (a chunked body: unknown, so "large")."""
    if "transfer-encoding" in req.headers:
        return 1 << 62
    try:
        return int(req.headers.get("content-length", "0") or 0)
    except ValueError:
        return 1 << 62


def _exfiltration(leaks: list[Leak], rule: Rule | None) -> Refused:
    names = ", ".join(sorted({lk.secret for lk in leaks}))
    where = f"rule '{rule.name}'" if rule is not None else "no rule"
    return Refused(
        Code.EXFILTRATION,
        f"the request carries a credential for secret(s) {names} that {where} does not bind "
        "to this destination",
        hint="placeholders are only honoured on the requests their rule binds",
    )


def _target(req: http.Request) -> str:
    if req.method == "CONNECT":
        return f"{req.host}:{req.port}"
    return f"{req.scheme}://{req.pretty_host}:{req.port}{A.redact_path(req.path)}"
