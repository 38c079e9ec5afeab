"""The values of a private key that the scrubber must know: every piece a client could turn
back into the key.

A PEM key is scrubbed and detected as more than its text. The text itself (without its
trailing line break, which an echo may drop) gives the whole PEM raw and JSON-escaped
(``\\n`` between the lines). The DER bytes give the base64 body as one string
at any offset of a larger blob, in either alphabet (`sandgate.secrets.forms`), and through the
unwrapping view (`sandgate.scrub.unwrap`) that body wrapped at any width with real line breaks: a
key leaked without its ``-----BEGIN``/``-----END`` lines is still caught. The body wrapped as PEM
wraps it, with JSON's ``\\n`` escapes instead of line breaks, is listed as it is (the view
undoes real breaks only). A partial leak is caught by the secret parts on their own: RSA's
primes, private exponent and CRT values, an EC key's private scalar, an Ed25519 or X25519 seed,
each enough to rebuild the key, and each scrubbed wherever it sits in a base64 or hex dump
(so in the DER of another format too: PKCS#1 and PKCS#8 both hold them).

Nothing here raises with a piece of the key in its message; a key that cannot be parsed still
gives its text and its body.
"""

from __future__ import annotations

import base64
import binascii
import re

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa, x448, x25519

PrivateKey = (rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
              | ed448.Ed448PrivateKey | x25519.X25519PrivateKey | x448.X448PrivateKey)

_PEM_BLOCK = re.compile(r"-----BEGIN [A-Z0-9 ]+-----(.*?)-----END [A-Z0-9 ]+-----", re.DOTALL)


def pem_values(pem: str) -> list[str | bytes]:
    """Every value of a PEM private key worth scrubbing (see the module)."""
    out: list[str | bytes] = [pem.strip()]
    for body in _PEM_BLOCK.findall(pem):
        lines = [ln.strip() for ln in body.splitlines() if ln.strip() and ":" not in ln]
        out.append("\\n".join(lines))
        try:
            out.append(base64.b64decode("".join(lines), validate=True))
        except (binascii.Error, ValueError):
            continue
    try:
        key = serialization.load_pem_private_key(pem.encode("utf-8", "surrogatepass"), None)
    except (ValueError, TypeError, UnsupportedAlgorithm):  # unreadable or encrypted: as is
        return _unique(out)
    if isinstance(key, PrivateKey):
        out += secret_parts(key)
    return _unique(out)


def held_key_values(key: PrivateKey) -> list[str | bytes]:
    """The values of a key Sandgate holds as an object (the audit signing key): those of its
    PKCS#8 PEM, which is how Sandgate writes it, and so of its DER and secret parts."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return pem_values(pem.decode("ascii"))


def secret_parts(key: PrivateKey) -> list[bytes]:
    """The parts of `key` each enough to rebuild it, big-endian (see the module)."""
    if isinstance(key, rsa.RSAPrivateKey):
        n = key.private_numbers()
        return [_int_bytes(v) for v in (n.p, n.q, n.d, n.dmp1, n.dmq1, n.iqmp)]
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return [_int_bytes(key.private_numbers().private_value)]
    # Ed25519, Ed448, X25519, X448: the raw private bytes are the key
    return [key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                              serialization.NoEncryption())]


def _int_bytes(v: int) -> bytes:
    return v.to_bytes((v.bit_length() + 7) // 8 or 1, "big")


def _unique(values: list[str | bytes]) -> list[str | bytes]:
    return list(dict.fromkeys(v for v in values if v))
