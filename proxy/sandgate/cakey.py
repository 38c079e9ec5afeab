"""The confdir CA as an ECDSA P-256 key: cheaper handshakes toward sandboxes.

mitmproxy signs every leaf certificate with its CA's key and puts the CA's public key in the
leaf (`mitmproxy.certs.dummy_cert`), so the CA's key type is the key type of every handshake a
sandbox makes with Sandgate. An RSA-2048 signature costs the proxy about a millisecond of CPU
per new connection; a P-256 signature a few dozen microseconds (`bench/focus.py --phase
new_conn` shows the difference). Every TLS client in use accepts P-256 (it is the mandatory
curve of TLS 1.3), and mitmproxy's default cipher list has the ECDHE-ECDSA suites for TLS 1.2.

`create_store` writes exactly the files mitmproxy's `CertStore.create_store` writes (same names,
same extensions, same modes), only with an EC key, so `mitmdump --set confdir=...` and every
path that loads the CA (`CertStore.from_store`) read it unchanged. An existing RSA CA keeps
working: nothing converts it; `sandgate ca --rotate` replaces it (docs/performance.md).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from mitmproxy.certs import CA_EXPIRY, CertStore


def create_ca(organization: str, cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed P-256 CA with the subject and extensions of mitmproxy's `create_ca`."""
    now = datetime.datetime.now()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization)])
    builder = (
        x509.CertificateBuilder()
        .serial_number(x509.random_serial_number())
        .subject_name(name)
        .issuer_name(name)
        .not_valid_before(now - datetime.timedelta(days=2))
        .not_valid_after(now + CA_EXPIRY)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
    )
    return key, builder.sign(private_key=key, algorithm=hashes.SHA256())


def create_store(path: Path, basename: str) -> None:
    """mitmproxy's CA files in `path` (`CertStore.create_store`'s layout), with a P-256 key."""
    path.mkdir(parents=True, exist_ok=True)
    key, ca = create_ca(organization=basename, cn=basename)
    pem_cert = ca.public_bytes(serialization.Encoding.PEM)
    with CertStore.umask_secret():
        (path / f"{basename}-ca.pem").write_bytes(
            key.private_bytes(encoding=serialization.Encoding.PEM,
                              format=serialization.PrivateFormat.TraditionalOpenSSL,
                              encryption_algorithm=serialization.NoEncryption())
            + pem_cert)
        (path / f"{basename}-ca.p12").write_bytes(pkcs12.serialize_key_and_certificates(
            name=basename.encode(), key=key, cert=ca, cas=None,
            encryption_algorithm=serialization.NoEncryption()))
    (path / f"{basename}-ca-cert.pem").write_bytes(pem_cert)
    (path / f"{basename}-ca-cert.cer").write_bytes(pem_cert)
    (path / f"{basename}-ca-cert.p12").write_bytes(pkcs12.serialize_key_and_certificates(
        name=basename.encode(), key=None, cert=ca, cas=None,
        encryption_algorithm=serialization.NoEncryption()))


def key_kind(ca_pem: Path) -> str:
    """"ECDSA P-256", "RSA 2048"...: the kind of the CA key in `ca_pem` (never its bytes)."""
    cert = x509.load_pem_x509_certificates(ca_pem.read_bytes())[0]
    public = cert.public_key()
    if isinstance(public, ec.EllipticCurvePublicKey):
        return "ECDSA P-256" if isinstance(public.curve, ec.SECP256R1) else \
            f"ECDSA {public.curve.name}"
    return f"{type(public).__name__.removesuffix('PublicKey').removeprefix('_')} " \
           f"{getattr(public, 'key_size', '?')}"
