"""Sandgate's configuration directory: the proxy-token key and mitmproxy's CA, created once.

Every subcommand that needs one of these creates it if missing, so whichever runs first
(`sandgate run`, `sandgate token issue`, `sandgate ca`) wins, and the others read what it wrote.
Creation is atomic: a half-written key or CA is never visible under its final name.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

TOKEN_KEY_FILE = "sandgate-token.key"
TOKEN_KEY_BYTES = 32

# mitmproxy's own names (mitmproxy.options: confdir; proxy.mode_servers / tlsconfig: CONF_BASENAME
# "mitmproxy", key size 2048), so `mitmdump --set confdir=...` and Sandgate share one CA.
CA_BASENAME = "mitmproxy"
CA_KEY_SIZE = 2048
CA_KEY_FILE = f"{CA_BASENAME}-ca.pem"  # private key + certificate: never print or copy
CA_CERT_FILE = f"{CA_BASENAME}-ca-cert.pem"  # the public certificate sandboxes trust


def ensure_confdir(path: Path) -> Path:
    """Create the configuration directory (mode 0700) if needed and return it.

    An existing directory readable by group or others is tightened to 0700: it holds the CA's
    private key and the token key.
    """
    path = Path(path).expanduser()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        with contextlib.suppress(PermissionError):
            path.chmod(0o700)
    return path


def _decode_key(raw: bytes, path: Path) -> bytes:
    if len(raw) == TOKEN_KEY_BYTES:
        return raw
    text = raw.strip()
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != TOKEN_KEY_BYTES:
        raise ValueError(
            f"{path} is not a valid token key: expected {TOKEN_KEY_BYTES} bytes, raw or base64"
        )
    return key


def _publish(tmp: Path, final: Path) -> bool:
    """Give `tmp` the name `final` unless `final` exists. True if ours was published."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    except OSError:
        # Filesystems without hard links: rename is atomic but would replace a concurrent
        # winner, so only use it when nothing is there yet (a small, benign race).
        if final.exists():
            return False
        os.replace(tmp, final)
        return True
    return True


def token_key(confdir: Path) -> bytes:
    """The HMAC key for proxy tokens, created (32 random bytes, base64, mode 0600) if missing."""
    confdir = Path(confdir)
    path = confdir / TOKEN_KEY_FILE
    if not path.exists():
        fd, tmp_name = tempfile.mkstemp(prefix=".sandgate-token.", dir=confdir)
        tmp = Path(tmp_name)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(base64.b64encode(secrets.token_bytes(TOKEN_KEY_BYTES)) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            _publish(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    return _decode_key(path.read_bytes(), path)


def _cert_from_ca_pem(ca_pem: Path) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    certs = x509.load_pem_x509_certificates(ca_pem.read_bytes())
    return certs[0].public_bytes(serialization.Encoding.PEM)


def ensure_ca(confdir: Path) -> Path:
    """Create mitmproxy's CA in `confdir` if missing; return the path of the public certificate.

    A new CA has an ECDSA P-256 key (`sandgate.cakey`, mitmproxy's file layout; an existing RSA
    CA is used as it is) and is generated in a private temporary directory and published by
    hard-linking `mitmproxy-ca.pem` (the file mitmproxy looks for), so two processes racing
    never mix one's key with the other's certificate. The returned file holds the certificate
    only, never the private key.
    """
    from mitmproxy.certs import CertStore

    from sandgate import cakey

    confdir = Path(confdir)
    ca_pem = confdir / CA_KEY_FILE
    if not ca_pem.exists():
        tmpdir = Path(tempfile.mkdtemp(prefix=".sandgate-ca.", dir=confdir))
        try:
            cakey.create_store(tmpdir, CA_BASENAME)  # ECDSA P-256: see sandgate.cakey
            if _publish(tmpdir / CA_KEY_FILE, ca_pem):
                # Ours won: the companion files (p12, .cer, cert pem) belong to this key.
                for companion in sorted(tmpdir.iterdir()):
                    if companion.name != CA_KEY_FILE:
                        os.replace(companion, confdir / companion.name)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    # Load it the way mitmproxy will (also writes its dhparam file): fails loudly if broken.
    CertStore.from_store(str(confdir), CA_BASENAME, CA_KEY_SIZE)

    # The public certificate must always match the key mitmproxy signs with, even after a race
    # or a hand-edited confdir: derive it from mitmproxy-ca.pem.
    cert_path = confdir / CA_CERT_FILE
    want = _cert_from_ca_pem(ca_pem)
    try:
        have = cert_path.read_bytes()
    except FileNotFoundError:
        have = b""
    if have != want:
        fd, tmp_name = tempfile.mkstemp(prefix=".sandgate-ca-cert.", dir=confdir)
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(want)
            os.replace(tmp_name, cert_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
    return cert_path


def rotate_ca(confdir: Path) -> Path:
    """Replace the confdir's CA with a new one (ECDSA P-256); return the new certificate's path.

    The old CA's files are kept beside it with a ``.old`` suffix (the key stays 0600), replacing
    any earlier ``.old``: a rotation can be undone by hand until the next one. A running proxy
    keeps the CA it loaded until it restarts; sandboxes must trust the new certificate.
    """
    confdir = Path(confdir)
    for name in sorted(p.name for p in confdir.glob(f"{CA_BASENAME}-ca*")):
        if not name.endswith(".old"):
            os.replace(confdir / name, confdir / f"{name}.old")
    return ensure_ca(confdir)
