"""Per-connection work of a new intercepted connection that is not the cryptography, removed
(profiled with py-spy under `bench/focus.py --phase new_conn`).

1. mitmproxy 12.3.1 hands the cached leaf certificate and the CA key to pyOpenSSL as
   cryptography objects (`TlsConfig.tls_start_client`), and pyOpenSSL converts them again for
   every client handshake (`SSL.Connection.use_certificate`: `X509.from_cryptography`
   serialises the certificate to DER and parses it back; `use_privatekey`:
   `PKey.from_cryptography_key`, the key likewise). Both results are immutable inputs to
   OpenSSL, so each is made once per certificate / key object and reused: the same bytes go to
   OpenSSL. (mitmproxy 11 converted the certificate itself, `Cert.to_pyopenssl`: no longer
   called, no longer patched.)
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



# What this patch replaces or depends on, each with the SHA-256 of its source: its entry
# in sandgate.mitm.registry.PATCHES.


# Leaf certificates converted and kept: CertStore keeps its own (cryptography) leaves cached
# (mitmproxy's `STORE_CAP`, 100); a few more here cost little and never grow past the bound.
CERT_CACHE = 256


class _Cache:
    """The pyOpenSSL form of the last `size` objects converted, keyed by the object itself
    (held, so its identity cannot be reused while its entry lives)."""

    def __init__(self, convert: Any, size: int) -> None:
        self._convert = convert
        self._size = size
        self._done: dict[int, tuple[Any, Any]] = {}

    def __call__(self, obj: Any) -> Any:
        hit = self._done.pop(id(obj), None)
        if hit is None or hit[0] is not obj:
            hit = (obj, self._convert(obj))
        self._done[id(obj)] = hit  # most recent last
        while len(self._done) > self._size:
            del self._done[next(iter(self._done))]
        return hit[1]


def install() -> None:
    if getattr(certs.Cert, _MARK, False):
        return
    # pyOpenSSL looks both up on the class at each call (OpenSSL.SSL imports the classes)
    certs_cache = _Cache(OpenSSL.crypto.X509.from_cryptography, CERT_CACHE)
    OpenSSL.crypto.X509.from_cryptography = staticmethod(certs_cache)  # type: ignore[assignment,method-assign]
    keys = _Cache(OpenSSL.crypto.PKey.from_cryptography_key, 4)  # the CA's key, in practice
    OpenSSL.crypto.PKey.from_cryptography_key = staticmethod(keys)  # type: ignore[assignment,method-assign]
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
