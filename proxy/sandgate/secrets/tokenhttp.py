"""Sandgate's own HTTP calls to credential issuers (OAuth token endpoints, GitHub's installation
token API): to the address the proxy checked, with TLS verified against the proxy's upstream
roots, bounded in time and size, never through a proxy from the environment."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from sandgate.errors import Unavailable

MAX_ANSWER = 64 * 1024  # a token answer is small; read no more

# url -> (the checked address to dial, its port); raises Refused/SecretError when the rules or
# the address checks refuse that endpoint for this caller.
Dial = Callable[[str], Awaitable[tuple[str, int]]]


class TokenFailure(Unavailable):
    """Why no credential (text safe to show: never a token, key or client secret)."""


class _Pinned(AbstractResolver):
    """aiohttp's resolver, answering only the address Sandgate checked (the name stays for TLS
    verification and the Host header)."""

    def __init__(self, host: str, ip: str, port: int) -> None:
        self.host, self.ip, self.port = host, ip, port

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        if host != self.host:
            raise OSError("not the checked endpoint")
        fam = socket.AF_INET6 if ":" in self.ip else socket.AF_INET
        return [ResolveResult(hostname=host, host=self.ip, port=self.port, family=fam, proto=0,
                              flags=socket.AI_NUMERICHOST)]

    async def close(self) -> None:
        return None


async def call(method: str, url: str, address: tuple[str, int], ssl_ctx: ssl.SSLContext,
               timeout: float, headers: Mapping[str, str], body: bytes | None = None,
               what: str = "the token endpoint") -> tuple[int, bytes]:
    """One request to `url`, dialled at `address`; (status, body) or TokenFailure."""
    host = urlsplit(url).hostname or ""
    connector = aiohttp.TCPConnector(resolver=_Pinned(host, *address), ssl=ssl_ctx,
                                     use_dns_cache=False, force_close=True)
    try:
        async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=timeout),
                trust_env=False) as session, session.request(
                method, url, data=body, headers=dict(headers), allow_redirects=False) as resp:
            data = await resp.content.read(MAX_ANSWER + 1)
            status = resp.status
    except TimeoutError:
        raise TokenFailure(f"{what} did not answer within {timeout:g}s") from None
    except aiohttp.ClientSSLError:
        raise TokenFailure(f"TLS to {what} failed verification") from None
    except (aiohttp.ClientError, OSError) as e:
        raise TokenFailure(f"{what} cannot be reached ({type(e).__name__})") from None
    if len(data) > MAX_ANSWER:
        raise TokenFailure(f"{what}'s answer is too large")
    return status, data
