"""The Sandgate addon: identify, decide, pin the dialled address, inject, scrub, audit.

Every hook is wrapped so that an exception inside it refuses the flow: mitmproxy itself only
logs a hook's exception and lets the flow continue, which for a security proxy would mean
forwarding a request nobody judged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mitmproxy import connection, http, tcp, tls, udp
from mitmproxy.proxy import server_hooks

from proxy import audit as A
from proxy.addons.state import METADATA_KEY, Conn, FlowRecord, Tunnel
from proxy.addons.stream import ResponseScrubber, scrub_headers
from proxy.decision import Decision, decide, decide_connect
from proxy.identity.base import Caller, IdentityError
from proxy.identity.resolve import Identifier
from proxy.inject import UnsafeValue, apply, find_leaks
from proxy.netguard import AddressRefused, IPAddress, choose_address, resolve
from proxy.policy.hosts import normalise_host
from proxy.policy.model import Policy, Rule
from proxy.refusal import REASON_HEADER, Code, Refusal
from proxy.request import RequestInfo
from proxy.scrub import scrub_text
from proxy.secrets.vault import SecretBroker, SecretError

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


def fail_closed(fn: F) -> F:
    """Run a hook; on any exception refuse whatever the hook was guarding."""

    @functools.wraps(fn)
    async def wrapper(self: Gate, obj: Any) -> None:
        try:
            await fn(self, obj)
        except Exception:
            log.exception("sandgate: %s hook failed; refusing", fn.__name__)
            self._fail(obj)

    return wrapper  # type: ignore[return-value]


class Gate:
    def __init__(self, config: GateConfig) -> None:
        self.cfg = config
        self.conns: dict[str, Conn] = {}
        self._placeholders = dict(config.policy.placeholders)

    # The policy can be swapped whole (hot reload); a hook reads it once per flow.
    @property
    def policy(self) -> Policy:
        return self.cfg.policy

    def set_policy(self, policy: Policy) -> None:
        self._placeholders = dict(policy.placeholders)
        self.cfg.policy = policy
        self.cfg.broker.update_secrets(policy.secrets)

    # ---------------------------------------------------------------- connections

    def _conn(self, client: connection.Client) -> Conn:
        c = self.conns.get(client.id)
        if c is None:
            c = self.conns[client.id] = Conn()
        return c

    def client_disconnected(self, client: connection.Client) -> None:
        self.conns.pop(client.id, None)

    # ---------------------------------------------------------------- CONNECT

    @fail_closed
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        req = flow.request
        auth = req.headers.get("proxy-authorization")
        try:
            caller = self.cfg.identifier.identify(auth, flow.client_conn.peername[0])
        except IdentityError as e:
            self._refuse(flow, Refusal(Code(e.code), str(e), target=_target(req)))
            return
        rec.caller = caller
        try:
            host = normalise_host(req.host)
        except ValueError as e:
            self._refuse(flow, Refusal(Code.BAD_REQUEST, f"bad CONNECT host: {e}",
                                       identity=caller.identity, target=_target(req)))
            return
        rec.info = RequestInfo("https", host, req.port, "CONNECT", "")
        d = decide_connect(self.policy, caller.identity, host, req.port)
        rec.decision = d
        if not d.allowed:
            refusal = _refusal_for(d, caller, f"{host}:{req.port}")
            if d.code in _DEFERRABLE:
                rec.refusal = refusal
                self._conn(flow.client_conn).tunnel = Tunnel(
                    caller=caller, host=host, port=req.port, rule=None, passthrough=False,
                    refusal=refusal,
                )
                self._audit(flow, event="connect")
            else:
                self._refuse(flow, refusal)
            return
        assert d.rule is not None
        self._conn(flow.client_conn).tunnel = Tunnel(
            caller=caller, host=host, port=req.port, rule=d.rule, passthrough=d.rule.passthrough
        )
        self._audit(flow, event="connect")

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        self._audit(flow, event="connect")

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        try:
            tunnel = self._conn(data.context.client).tunnel
            if tunnel is None or not tunnel.passthrough:
                return
            sni = data.client_hello.sni
            # Pass through only what the CONNECT named; otherwise intercept and let the request
            # hook refuse the disagreement with a readable answer.
            if sni is not None and _same_host(sni, tunnel.host):
                data.ignore_connection = True
        except Exception:
            log.exception("sandgate: tls_clienthello failed; intercepting instead")

    @fail_closed
    async def tcp_start(self, flow: tcp.TCPFlow) -> None:
        tunnel = self._conn(flow.client_conn).tunnel
        if tunnel is None or not tunnel.passthrough:
            # Raw bytes inside a CONNECT that no passthrough rule allows: nothing to judge.
            flow.kill()

    @fail_closed
    async def udp_start(self, flow: udp.UDPFlow) -> None:
        flow.kill()

    # ---------------------------------------------------------------- dialling

    @fail_closed
    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """The one place every upstream dial passes: only approved, checked addresses go."""
        conn = self._conn(data.client)
        server = data.server
        address = server.address
        if address is None:
            server.error = "sandgate: no address"
            return
        key = (str(address[0]), int(address[1]))
        if key in conn.approved:
            # We dial the checked IP; TLS must still verify the name the request was judged for.
            server.sni = conn.approved[key]
            return
        tunnel = conn.tunnel
        if tunnel is not None and tunnel.passthrough and tunnel.rule is not None:
            if _same_host(str(address[0]), tunnel.host) and address[1] == tunnel.port:
                target = await self._choose(tunnel.host, tunnel.port, tunnel.rule)
                server.address = target.address
                return
        server.error = "sandgate: connection was not approved"

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

    async def _choose(self, host: str, port: int, rule: Rule) -> Any:
        ips = await resolve(host, port, self.cfg.resolve_overrides)
        return choose_address(host, port, ips, rule.private_cidrs, self.cfg.self_addresses)

    # ---------------------------------------------------------------- requests

    @fail_closed
    async def request(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        req = flow.request
        conn = self._conn(flow.client_conn)
        auth = req.headers.pop("proxy-authorization", None)
        req.headers.pop(REASON_HEADER, None)
        tunnel = conn.tunnel

        if tunnel is not None:
            caller = tunnel.caller
        else:
            try:
                caller = self.cfg.identifier.identify(auth, flow.client_conn.peername[0])
            except IdentityError as e:
                self._refuse(flow, Refusal(Code(e.code), str(e), target=_target(req)))
                return
        rec.caller = caller

        info, problem = _request_info(flow, tunnel)
        rec.info = info
        if tunnel is not None and tunnel.refusal is not None:
            self._refuse(flow, tunnel.refusal)
            return
        if problem is not None:
            self._refuse(flow, Refusal(Code(problem[0]), problem[1], identity=caller.identity,
                                       target=_target(req)))
            return
        assert info is not None

        policy, placeholders = self.policy, self._placeholders
        d = decide(policy, caller.identity, info)
        rec.decision = d
        if not d.allowed:
            self._refuse(flow, _refusal_for(d, caller, info.target))
            return
        rule = d.rule
        assert rule is not None

        leaks = find_leaks(req, placeholders, self.cfg.broker.cached_values(), rule.secrets)
        if leaks:
            rec.exfiltration = sorted({f"{lk.secret}:{lk.kind}:{lk.where}" for lk in leaks})
            names = ", ".join(sorted({lk.secret for lk in leaks}))
            self._refuse(flow, Refusal(
                Code.EXFILTRATION,
                f"the request carries a credential for secret(s) {names} that rule "
                f"'{rule.name}' does not bind to this destination",
                identity=caller.identity, target=info.target,
                hint="placeholders are only honoured on the requests their rule binds",
            ))
            return

        if rule.secrets:
            if info.scheme != "https" or _upstream_unverified():
                self._refuse(flow, Refusal(
                    Code.UNSAFE_INJECTION,
                    "credentials are injected only over verified TLS to the upstream",
                    identity=caller.identity, target=info.target,
                ))
                return
            values: dict[str, str] = {}
            try:
                for name in sorted(rule.secrets):
                    sv = await self.cfg.broker.get(name)
                    values[name] = sv.value
                    rec.secrets.append(f"{name}@{sv.version}" if sv.version else name)
            except SecretError as e:
                self._refuse(flow, Refusal(Code.SECRET_UNAVAILABLE, str(e),
                                           identity=caller.identity, target=info.target,
                                           hint="nothing was sent upstream; retry later"))
                return
            bound_placeholders = {n: policy.secrets[n].placeholder for n in values}
            try:
                apply(rule, req, values, bound_placeholders)
            except UnsafeValue as e:
                self._refuse(flow, Refusal(Code.UNSAFE_INJECTION, str(e),
                                           identity=caller.identity, target=info.target))
                return

        try:
            target = conn.pinned.get((info.host, info.port))
            if target is None or not _pin_still_allowed(target, rule, self.cfg):
                target = await self._choose(info.host, info.port, rule)
                conn.pinned[(info.host, info.port)] = target
        except AddressRefused as e:
            self._refuse(flow, Refusal(Code(e.code), str(e), identity=caller.identity,
                                       target=info.target,
                                       hint="name the range in the rule's private_cidrs "
                                       "only if this destination is meant to be reachable"))
            return
        rec.dialed = f"{target.ip}:{target.port}"
        conn.approved[(str(target.ip), target.port)] = info.host
        # Dial exactly the checked address; the Host header and SNI keep the name.
        req.data.host = str(target.ip)
        # Scrubbing needs plain bytes: ask the upstream not to compress.
        req.headers["accept-encoding"] = "identity"

    # ---------------------------------------------------------------- responses

    @fail_closed
    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        rec = _record(flow)
        resp = flow.response
        if resp is None or rec.refused:
            return
        resp.headers.pop(REASON_HEADER, None)
        secrets = self.cfg.broker.cached_values()
        rec.redactions += scrub_headers(resp.headers, secrets)
        if flow.request.method == "HEAD" or resp.status_code in (204, 304) or (
            resp.status_code < 200
        ):
            return  # no body: nothing to stream or reframe
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        scrubber = ResponseScrubber(secrets, encoding, resp)
        if scrubber.refuse_reason:
            flow.kill()
            rec.refusal = Refusal(Code.INTERNAL_ERROR, scrubber.refuse_reason)
            return
        rec_ref = rec

        def stream(chunk: bytes) -> bytes | list[bytes]:
            out = scrubber(chunk)
            rec_ref.redactions = scrubber.replacements
            rec_ref.bytes_out += sum(len(c) for c in out)
            return out

        resp.stream = stream

    def response(self, flow: http.HTTPFlow) -> None:
        self._audit(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._audit(flow)

    # ---------------------------------------------------------------- refusals and audit

    def _refuse(self, flow: http.HTTPFlow, refusal: Refusal) -> None:
        secrets = self.cfg.broker.cached_values()
        if secrets:  # the reason may quote the request, and the request may quote a value
            def clean(text: str | None) -> str | None:
                return scrub_text(text, secrets)[0] if text else text

            refusal = dataclasses.replace(refusal, reason=clean(refusal.reason) or "",
                                          target=clean(refusal.target), hint=clean(refusal.hint))
        rec = _record(flow)
        rec.refusal = refusal
        flow.response = http.Response.make(refusal.status, refusal.body(), refusal.headers())
        if refusal.status == 407 or flow.request.method == "CONNECT":
            flow.response.headers["connection"] = "close"

    def _audit(self, flow: http.HTTPFlow, event: str = "request") -> None:
        rec = _record(flow)
        if rec.audited:
            return
        rec.audited = True
        try:
            fields = _audit_fields(flow, rec)
            # A sandbox that somehow holds a real value may put it in a path or Host: the audit
            # line must not carry it on.
            secrets = self.cfg.broker.cached_values()
            for key in (A.PATH, A.HOST, A.REASON, "error"):
                if isinstance(fields.get(key), str):
                    fields[key] = scrub_text(fields[key], secrets)[0]
            self.cfg.audit.emit(event, **fields)
        except Exception:
            log.exception("sandgate: audit failed")


def _record(flow: http.HTTPFlow) -> FlowRecord:
    rec = flow.metadata.get(METADATA_KEY)
    if rec is None:
        rec = flow.metadata[METADATA_KEY] = FlowRecord()
    assert isinstance(rec, FlowRecord)
    return rec


def _target(req: http.Request) -> str:
    return f"{req.scheme}://{req.pretty_host}:{req.port}{A.redact_path(req.path)}" if (
        req.method != "CONNECT") else f"{req.host}:{req.port}"


def _same_host(a: str, b: str) -> bool:
    try:
        return normalise_host(a) == normalise_host(b)
    except ValueError:
        return False


def _upstream_unverified() -> bool:
    from mitmproxy import ctx

    return bool(ctx.options.ssl_insecure)


def _pin_still_allowed(target: Any, rule: Rule, cfg: GateConfig) -> bool:
    from proxy.netguard import classify

    if classify(target.ip) is None:
        return True
    return any(target.ip.version == n.version and target.ip in n for n in rule.private_cidrs)


def _request_info(
    flow: http.HTTPFlow, tunnel: Tunnel | None
) -> tuple[RequestInfo | None, tuple[str, str] | None]:
    """The request as the policy sees it, or why it is malformed or inconsistent."""
    req = flow.request
    try:
        host = normalise_host(req.host)
    except ValueError as e:
        return None, (Code.BAD_REQUEST, f"bad host: {e}")
    header = req.host_header
    if header is not None:
        try:
            hh_host, hh_port = _split_authority(header, req.scheme)
        except ValueError as e:
            return None, (Code.BAD_REQUEST, f"bad Host header: {e}")
        if hh_host != host or hh_port != req.port:
            return None, (Code.BAD_REQUEST,
                          f"the Host header ({header}) disagrees with the request target "
                          f"({host}:{req.port})")
    info = RequestInfo(req.scheme, host, req.port, req.method.upper(), req.path.split("?", 1)[0])
    if tunnel is not None:
        if not flow.client_conn.tls_established:
            return info, (Code.NOT_TLS,
                          f"the CONNECT tunnel to {tunnel.host}:{tunnel.port} does not carry TLS")
        if host != tunnel.host or req.port != tunnel.port:
            return info, (Code.BAD_REQUEST,
                          f"the request for {host}:{req.port} disagrees with the CONNECT target "
                          f"{tunnel.host}:{tunnel.port}")
        sni = flow.client_conn.sni
        if sni is None:
            from proxy.netguard import parse_ip_literal

            if parse_ip_literal(tunnel.host) is None:
                return info, (Code.BAD_REQUEST, "the TLS handshake carried no SNI")
        elif not _same_host(sni, tunnel.host):
            return info, (Code.BAD_REQUEST,
                          f"the TLS SNI ({sni}) disagrees with the CONNECT target ({tunnel.host})")
    elif req.scheme == "https":
        # https without a CONNECT (e.g. a TLS client talking to the proxy port directly).
        return info, (Code.BAD_REQUEST, "https requests must arrive through CONNECT")
    return info, None


def _split_authority(authority: str, scheme: str) -> tuple[str, int]:
    from mitmproxy.net.http import url

    host, port = url.parse_authority(authority, check=True)
    return normalise_host(host), port or (443 if scheme == "https" else 80)


def _refusal_for(d: Decision, caller: Caller, target: str) -> Refusal:
    assert d.code is not None
    return Refusal(d.code, d.reason, identity=caller.identity, target=target, hint=d.hint)


def _audit_fields(flow: http.HTTPFlow, rec: FlowRecord) -> dict[str, Any]:
    info = rec.info
    req = flow.request
    refusal = rec.refusal
    decision = "deny" if refusal is not None or (rec.decision and not rec.decision.allowed) else (
        "allow" if rec.decision else "deny")
    code = refusal.code if refusal else (rec.decision.code if rec.decision else None)
    if flow.error and not refusal and decision == "allow":
        code = None
    reason = refusal.reason if refusal else (rec.decision.reason if rec.decision else
                                             (flow.error.msg if flow.error else "not judged"))
    client = flow.client_conn.peername
    resp = flow.response
    return {
        A.IDENTITY: rec.caller.identity if rec.caller else None,
        A.SANDBOX: rec.caller.sandbox if rec.caller else None,
        A.IDENTITY_SOURCE: rec.caller.source if rec.caller else None,
        A.CLIENT: f"{client[0]}:{client[1]}" if client else None,
        A.METHOD: req.method,
        A.SCHEME: info.scheme if info else req.scheme,
        A.HOST: info.host if info else req.pretty_host,
        A.PORT: info.port if info else req.port,
        A.PATH: A.redact_path(req.path) if req.method != "CONNECT" else None,
        A.RULE: rec.decision.rule_name if rec.decision else None,
        A.DECISION: decision,
        A.CODE: str(code) if code else None,
        A.REASON: reason,
        A.SECRETS: rec.secrets,
        A.UPSTREAM_STATUS: resp.status_code if resp is not None and not rec.refused else None,
        A.BYTES_IN: len(req.raw_content or b""),
        A.BYTES_OUT: rec.bytes_out if not rec.refused else (len(resp.raw_content or b"")
                                                             if resp is not None else 0),
        A.DURATION_MS: round((time.monotonic() - rec.started) * 1000, 2),
        A.DIALED: rec.dialed,
        A.EXFIL: rec.exfiltration,
        A.REDACTIONS: rec.redactions,
        "error": flow.error.msg if flow.error and not refusal else None,
    }
