"""New intercepted connections toward sandboxes: the confdir CA's ECDSA P-256 leaf, and TLS
session resumption (tickets) that skips the signature but never the judgement.

A resumed session carries only TLS keys: who is calling comes from the CONNECT (its
Proxy-Authorization), and every request inside is judged as before, so a ticket one identity
got does not carry its rights into another identity's tunnel.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from tests.support.tunnel import granted_tunnel, recv_until_closed


@dataclass
class Answer:
    out: bytes
    reused: bool
    leaf: bytes
    session: ssl.SSLSession | None


def _get(proxy, identity: str, path: str, session: ssl.SSLSession | None = None) -> Answer:
    s = granted_tunnel(proxy, identity, "upstream.test")
    ctx = _CTX.setdefault(str(proxy.ca), ssl.create_default_context(cafile=str(proxy.ca)))
    tls = ctx.wrap_socket(s, server_hostname="upstream.test", session=session)
    leaf, reused = tls.getpeercert(binary_form=True) or b"", tls.session_reused
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: upstream.test\r\n\r\n".encode())
    out = recv_until_closed(tls, stop=b"\r\n\r\n", timeout=5)  # reads the TLS 1.3 tickets
    got = tls.session
    tls.close()
    return Answer(out, reused, leaf, got)


_CTX: dict[str, ssl.SSLContext] = {}


def test_leaf_certificate_is_ecdsa_p256(proxy, upstream):
    a = _get(proxy, "coding-agent", "/docs/x")
    assert a.out.startswith(b"HTTP/1.1 200"), a.out[:200]
    key = x509.load_der_x509_certificate(a.leaf).public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"


def test_session_resumes_and_every_request_is_still_judged(proxy, upstream):
    first = _get(proxy, "web-fetch", "/docs/x")
    assert first.out.startswith(b"HTTP/1.1 200"), first.out[:200]
    assert not first.reused
    session = first.session
    assert session is not None and session.has_ticket

    # the same identity resumes: no new signature, same answer
    again = _get(proxy, "web-fetch", "/docs/y", session)
    assert again.reused
    assert again.out.startswith(b"HTTP/1.1 200"), again.out[:200]

    # another identity presents the ticket: resumed TLS, but judged as itself (the no-admin
    # rule of coding-agent refuses what web-fetch may fetch), and audited as itself
    before = len(upstream.seen)
    other = _get(proxy, "coding-agent", "/admin/x", session)
    assert other.reused
    assert other.out.startswith(b"HTTP/1.1 403"), other.out[:200]
    assert len(upstream.seen) == before
    ev = proxy.wait_audit(lambda e: e.get("path") == "/admin/x" and e.get("decision") == "deny")
    assert ev.get("identity") == "coding-agent"
