"""Per-connection work of a new intercepted connection that is not the cryptography, removed
(profiled with py-spy under `bench/focus.py --phase new_conn`).

1. mitmproxy converts the cached leaf certificate and the CA key to pyOpenSSL objects again for
   every client handshake (`TlsConfig.tls_start_client`: `Cert.to_pyopenssl` re-parses the
   certificate, `PKey.from_cryptography_key` serialises the key to DER and loads it back).
   Both results are immutable inputs to `SSL.Connection.use_certificate`/`use_privatekey`, so
   each is made once per certificate / key object and reused: the same bytes go to OpenSSL.
2. Every task mitmproxy creates reads ``os.environ["PYTEST_CURRENT_TEST"]`` to decorate the
   task's debug name (`mitmproxy.utils.asyncio_utils.set_task_debug_info`, under
   ``__debug__``): a few tasks per connection, about 1-3% of a passthrough tunnel's CPU. The
   variable is read once, at install.

Neither changes what is verified, sent or pinned; the TLS options stay mitmproxy's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import OpenSSL.crypto
from mitmproxy import certs
from mitmproxy.utils import asyncio_utils

_MARK = "_sandgate_handshake"

_X509_ATTR = "_sandgate_x509"  # on the Cert (it lives in mitmproxy's CertStore cache)


def _to_pyopenssl(self: certs.Cert) -> OpenSSL.crypto.X509:
    x509: OpenSSL.crypto.X509 | None = self.__dict__.get(_X509_ATTR)
    if x509 is None:
        x509 = self.__dict__[_X509_ATTR] = OpenSSL.crypto.X509.from_cryptography(self._cert)
    return x509


class _KeyCache:
    """The pyOpenSSL form of the last few private keys converted (the CA's, in practice),
    keyed by the key object itself (held, so its identity cannot be reused)."""

    def __init__(self, convert: Any) -> None:
        self._convert = convert
        self._keys: list[tuple[Any, OpenSSL.crypto.PKey]] = []

    def __call__(self, key: Any) -> OpenSSL.crypto.PKey:
        for have, cached in self._keys:
            if have is key:
                return cached
        pkey: OpenSSL.crypto.PKey = self._convert(key)
        self._keys = [(key, pkey), *self._keys[:3]]
        return pkey


def install() -> None:
    if getattr(certs.Cert, _MARK, False):
        return
    certs.Cert.to_pyopenssl = _to_pyopenssl  # type: ignore[method-assign]
    convert = _KeyCache(OpenSSL.crypto.PKey.from_cryptography_key)
    OpenSSL.crypto.PKey.from_cryptography_key = staticmethod(convert)  # type: ignore[assignment,method-assign]
    test = os.environ.get("PYTEST_CURRENT_TEST")

    def set_task_debug_info(task: Any, *, name: str, client: tuple[Any, ...] | None = None
                            ) -> None:
        task.created = time.time()
        task.set_name(f"{name} [created in {test}]" if test else name)
        if client:
            task.client = client

    asyncio_utils.set_task_debug_info = set_task_debug_info
    setattr(certs.Cert, _MARK, True)


def installed() -> bool:
    return bool(getattr(certs.Cert, _MARK, False))
