"""sandgate.mitm.speedups.handshake: the per-connection conversions mitmproxy repeats are made once,
and give the same bytes to OpenSSL."""

from __future__ import annotations

import asyncio

import OpenSSL.crypto
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from mitmproxy import certs
from mitmproxy.utils import asyncio_utils

from sandgate import cakey
from sandgate.mitm.speedups import handshake


def test_certificate_and_key_are_converted_once_and_unchanged() -> None:
    handshake.install()
    assert handshake.installed()
    key, ca = cakey.create_ca("o", "cn")
    cert = certs.Cert(ca)
    # what pyOpenSSL's use_certificate does with mitmproxy 12's cryptography certificate
    first = OpenSSL.crypto.X509.from_cryptography(cert.to_cryptography())
    assert OpenSSL.crypto.X509.from_cryptography(cert.to_cryptography()) is first
    assert OpenSSL.crypto.dump_certificate(OpenSSL.crypto.FILETYPE_ASN1, first) == \
        ca.public_bytes(serialization.Encoding.DER)
    other = certs.Cert(cakey.create_ca("o", "cn2")[1])
    assert OpenSSL.crypto.X509.from_cryptography(other.to_cryptography()) is not first

    pkey = OpenSSL.crypto.PKey.from_cryptography_key(key)
    assert OpenSSL.crypto.PKey.from_cryptography_key(key) is pkey
    assert pkey.to_cryptography_key().private_numbers() == key.private_numbers()
    key2 = ec.generate_private_key(ec.SECP256R1())
    pkey2 = OpenSSL.crypto.PKey.from_cryptography_key(key2)
    assert pkey2 is not pkey
    assert pkey2.to_cryptography_key().private_numbers() == key2.private_numbers()
    # a public key converts too (and is not confused with the private one)
    pub = OpenSSL.crypto.PKey.from_cryptography_key(key.public_key())
    assert pub is not pkey


def test_task_debug_info_still_names_tasks() -> None:
    handshake.install()

    async def main() -> str:
        t = asyncio_utils.create_task(asyncio.sleep(0), name="probe", keep_ref=True,
                                      client=("a", 1))
        await t
        assert t.client == ("a", 1)  # type: ignore[attr-defined]
        assert t.created > 0  # type: ignore[attr-defined]
        return t.get_name()

    assert asyncio.run(main()).startswith("probe")


def test_cache_is_bounded_and_keyed_by_identity() -> None:
    made: list[object] = []

    def convert(obj: object) -> object:
        made.append(obj)
        return ("converted", len(made))

    cache = handshake._Cache(convert, 2)
    a, b, c = object(), object(), object()
    assert cache(a) is cache(a) and len(made) == 1
    cache(b)
    cache(c)  # a is the oldest: dropped
    assert len(cache._done) == 2
    cache(a)
    assert len(made) == 4
