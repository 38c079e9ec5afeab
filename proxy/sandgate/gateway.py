"""Base-URL gateway mode: a request to `http://sandgate:PORT/PREFIX/rest` becomes the proxied
request `https://UPSTREAM/rest`, and the caller's Sandgate token comes from the gateway's
`token_header` instead of Proxy-Authorization.

Only the mapping lives here. The request it maps to is built by the one request parser
(`parse_proxied`) and judged by the one decision function; identity, injection, leak checks,
scrubbing, streaming and audit are the proxy's own code path (addons/gate.py). `sandgate explain
--gateway` maps a gateway path with the same `route`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mitmproxy.http import Headers

from sandgate.errors import BadRequest, Code, IdentityError
from sandgate.policy.model import Gateway
from sandgate.request import RequestInfo, parse_proxied
from sandgate.tokens import VERSION


@dataclass(frozen=True, slots=True)
class Routed:
    gateway: Gateway
    path: str  # the upstream path and query: what follows the prefix ("/" when nothing does)
    info: RequestInfo  # the request as the policy sees it: upstream host, path after the prefix


def route(gateways: Sequence[Gateway], method: str, target: str) -> Routed:
    """The gateway serving `target` (the raw request target), and the upstream request.

    The prefix is matched literally and must be followed by '/', '?' or nothing: `/anthropicx`
    and `/anthropic%2F..` are no gateway's. What follows is the upstream path exactly as the
    client sent it, judged like the path of a proxied request (dot segments and encoded
    slashes are resolved by the decision's path canonicaliser, and the upstream host is the
    gateway's whatever the path says).
    """
    if not target.startswith("/"):
        raise BadRequest(Code.BAD_REQUEST, "the gateway takes origin-form targets only "
                         "(a path such as /anthropic/v1/messages)")
    path, qmark, query = target.partition("?")
    for gw in gateways:
        if path == gw.prefix or path.startswith(gw.prefix + "/"):
            rest = path[len(gw.prefix):] or "/"
            upstream_target = rest + (qmark + query if qmark else "")
            info = parse_proxied("https", gw.host, gw.port, method, upstream_target, None)
            return Routed(gw, upstream_target, info)
    known = ", ".join(g.prefix for g in gateways) or "(none configured)"
    raise BadRequest(Code.NO_GATEWAY, f"no gateway serves the path {_short(path)!r}",
                     hint=f"set the SDK's base URL to http(s)://SANDGATE:PORT followed by one "
                     f"of the gateway prefixes: {known}")


def take_token(headers: Headers, gateway: Gateway, address_known: bool) -> str | None:
    """The Sandgate token the request carries in the gateway's token header (exactly one of
    them, once), removed from the headers. None when the caller is identified by its address
    and no token header holds a token (a placeholder there is left in place for the rule to
    swap). Raises IdentityError when there is no token and no address identity either, or when
    the token is ambiguous. Never echoes a header's value."""
    names = gateway.token_headers
    said = " or ".join(names)
    carrying: list[tuple[str, str]] = []
    present = False
    for name in names:
        values = headers.get_all(name)
        if len(values) > 1:
            raise IdentityError(Code.AUTH_INVALID, f"the {name} header is given {len(values)} "
                                "times; send the Sandgate token once")
        if not values:
            continue
        present = True
        token = _token_in(name, values[0])
        if token is not None:
            carrying.append((name, token))
    if len(carrying) > 1:
        raise IdentityError(Code.AUTH_INVALID, f"{' and '.join(n for n, _ in carrying)} both "
                            "carry a Sandgate token; send it in one header")
    if carrying:
        name, token = carrying[0]
        del headers[name]
        return token
    if address_known:
        return None
    if not present:
        raise IdentityError(Code.AUTH_REQUIRED, f"gateway authentication required: put the "
                            f"Sandgate token in the {said} header (where the SDK puts its API "
                            "key)")
    raise IdentityError(Code.AUTH_INVALID, f"the {said} header does not carry a Sandgate "
                        f"token (a token starts with {VERSION}.)")


def _token_in(name: str, value: str) -> str | None:
    """The token in a header value (`Bearer TOKEN` accepted in authorization), or None."""
    value = value.strip()
    if name == "authorization":
        scheme, sep, rest = value.partition(" ")
        if sep and scheme.lower() == "bearer":
            value = rest.strip()
    return value if value.startswith(VERSION + ".") else None


def gateway_url(gateways: Sequence[Gateway], method: str, target: str) -> tuple[str, Gateway]:
    """For `sandgate explain --gateway`: the upstream URL a gateway path is judged as."""
    r = route(gateways, method, target)
    return f"{r.gateway.upstream}{r.path}", r.gateway


def _short(text: str) -> str:
    return text if len(text) <= 100 else text[:100] + "..."
