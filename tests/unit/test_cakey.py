"""The confdir CA: new ones are ECDSA P-256, mitmproxy loads them and signs P-256 leaves with
them; an existing RSA CA keeps working; `sandgate ca --rotate` replaces a CA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from mitmproxy.certs import CertStore

from sandgate import cakey, confdir


def _leaf(conf: Path, host: str) -> tuple[x509.Certificate, x509.Certificate]:
    store = CertStore.from_store(str(conf), confdir.CA_BASENAME, confdir.CA_KEY_SIZE)
    entry = store.get_cert(host, [x509.DNSName(host)])
    return entry.cert._cert, store.default_ca._cert


def test_a_new_ca_is_p256_and_signs_p256_leaves(tmp_path: Path) -> None:
    conf = confdir.ensure_confdir(tmp_path / "c")
    cert_path = confdir.ensure_ca(conf)
    ca = x509.load_pem_x509_certificate(cert_path.read_bytes())
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert isinstance(ca.public_key().curve, ec.SECP256R1)
    assert cakey.key_kind(conf / confdir.CA_KEY_FILE) == "ECDSA P-256"
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert b"PRIVATE KEY" not in cert_path.read_bytes()
    assert (conf / confdir.CA_KEY_FILE).stat().st_mode & 0o077 == 0

    leaf, loaded_ca = _leaf(conf, "api.example.test")
    assert loaded_ca == ca
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
    pub = ca.public_key()
    assert isinstance(pub, ec.EllipticCurvePublicKey)
    pub.verify(leaf.signature, leaf.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
    assert leaf.issuer == ca.subject


def test_an_existing_rsa_ca_keeps_working(tmp_path: Path) -> None:
    conf = confdir.ensure_confdir(tmp_path / "c")
    CertStore.create_store(conf, confdir.CA_BASENAME, 2048)
    before = (conf / confdir.CA_KEY_FILE).read_bytes()
    cert_path = confdir.ensure_ca(conf)
    assert (conf / confdir.CA_KEY_FILE).read_bytes() == before
    ca = x509.load_pem_x509_certificate(cert_path.read_bytes())
    assert isinstance(ca.public_key(), rsa.RSAPublicKey)
    assert cakey.key_kind(conf / confdir.CA_KEY_FILE) == "RSA 2048"
    leaf, _ = _leaf(conf, "api.example.test")
    pub = ca.public_key()
    assert isinstance(pub, rsa.RSAPublicKey)
    pub.verify(leaf.signature, leaf.tbs_certificate_bytes, padding.PKCS1v15(), hashes.SHA256())


def test_rotate_replaces_an_rsa_ca_with_p256_and_keeps_the_old_files(tmp_path: Path) -> None:
    conf = confdir.ensure_confdir(tmp_path / "c")
    CertStore.create_store(conf, confdir.CA_BASENAME, 2048)
    old_key = (conf / confdir.CA_KEY_FILE).read_bytes()
    env_python = [sys.executable, "-m", "sandgate.cli"]
    out = subprocess.run([*env_python, "ca", "--confdir", str(conf), "--rotate"],
                         capture_output=True, text=True, check=True)
    assert "ECDSA P-256" in out.stderr and "PRIVATE" not in out.stdout + out.stderr
    new = x509.load_pem_x509_certificate(out.stdout.encode())
    assert isinstance(new.public_key(), ec.EllipticCurvePublicKey)
    assert (conf / f"{confdir.CA_KEY_FILE}.old").read_bytes() == old_key
    assert (conf / f"{confdir.CA_KEY_FILE}.old").stat().st_mode & 0o077 == 0
    assert (conf / confdir.CA_CERT_FILE).read_bytes() == out.stdout.encode()
    # without --rotate the CA stays
    again = subprocess.run([*env_python, "ca", "--confdir", str(conf)],
                           capture_output=True, text=True, check=True)
    assert again.stdout == out.stdout
