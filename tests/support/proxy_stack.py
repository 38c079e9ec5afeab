"""Fixtures and helpers shared by tests/integration/test_side_channels.py and
test_request_integrity.py.

Each test module imports the fixtures it uses; they are module-scoped, so the servers of one
module are gone before the next module binds the same addresses. Addresses (127.0.0.2:80/443
belong to the shared fixtures):

    127.0.0.3:443  ws.r2.test     WsServer (aiohttp, TLS)
    127.0.0.4:443  raw.r2.test    RawServer (HTTP/1 by hand, TLS)
    127.0.0.5:443  h2.r2.test     H2TrailerServer (h2 only)
    127.0.0.6:443  nginx.r2.test  nginx, vhosts nginx.r2.test (default) and other.test
    127.0.0.7:443  up.r2.test     RawServer that switches to any Upgrade (TLS), and :80 plain
    ::ffff:0:7f00:2  x.r2.test    IPv4-translated 127.0.0.2 (nothing listens)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.integration.conftest import Proxy, start_proxy, stop_proxy
from tests.support.secrets import assert_no_secret, fingerprint

HERE = Path(__file__).resolve().parent.parent / "integration"
POLICIES_R2 = HERE / "policies_channel_servers"

R2_RESOLVE = {
    "ws.r2.test": "127.0.0.3",
    "raw.r2.test": "127.0.0.4",
    "h2.r2.test": "127.0.0.5",
    "nginx.r2.test": "127.0.0.6",
    "other.test": "127.0.0.6",
    "up.r2.test": "127.0.0.7",
    "x.r2.test": "::ffff:0:7f00:2",
}


def resolve_args(extra: dict[str, str] | None = None) -> list[str]:
    names = {**R2_RESOLVE, **(extra or {})}
    return [f"--resolve={n}={ip}" for n, ip in names.items()]


def vault_env(vault) -> dict[str, str]:
    return {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token}


def r2_proxy_running(tmp_path_factory, vault, pki) -> Iterator[Proxy]:
    """`sandgate run` with policies_channel_servers/ and the names above (a test module's fixture
    body: `yield from r2_proxy_running(...)`)."""
    from tests.integration.conftest import SECRET_VALUES

    tmp = tmp_path_factory.mktemp("r2proxy")
    p = start_proxy(tmp, POLICIES_R2, vault_env(vault), pki, *resolve_args())
    yield p
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], SECRET_VALUES, "the side-channel proxy's logs or audit")


_TOKENS: dict[tuple[int, str], str] = {}


def token(proxy: Proxy, identity: str = "coding-agent") -> str:
    """One token per proxy and identity: issuing one runs a subprocess."""
    key = (proxy.port, identity)
    if key not in _TOKENS:
        _TOKENS[key] = proxy.token(identity)
    return _TOKENS[key]


def seen_count(server) -> int:
    """How many requests an upstream recorded. Compare counts, never lists: pytest would print
    the recorded requests, and they hold the injected key."""
    return len(server.seen)


def audit_mark(proxy: Proxy) -> int:
    return len(proxy.audit())


def wait_new_audit(proxy: Proxy, mark: int, pred: Callable[[dict], bool],
                   timeout: float = 5.0) -> dict:
    """The first audit event after `mark` that satisfies `pred` (bounded wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in proxy.audit()[mark:]:
            if pred(ev):
                return ev
        time.sleep(0.05)
    evs = [{k: e.get(k) for k in ("event", "method", "host", "path", "decision", "code")}
           for e in proxy.audit()[mark:]]
    raise AssertionError(f"no matching audit event after mark {mark}; new events: {evs}")


def refusal_doc(body: bytes | str) -> dict:
    """Sandgate's JSON refusal body; fails readably when the body is something else."""
    from tests.integration.conftest import SECRET_VALUES

    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        doc = json.loads(text)
    except ValueError:
        shown = text[:300]
        for s in SECRET_VALUES:  # never print a value, even in a failure
            shown = shown.replace(s, fingerprint(s))
        raise AssertionError(f"not Sandgate's JSON refusal body: {shown!r}") from None
    if isinstance(doc.get("sandgate"), dict):  # an LLM call: the provider's error shape
        doc = doc["sandgate"]                     # with Sandgate's refusal inside (refusal.py)
    assert doc.get("error") == "sandgate_refused", doc
    return doc
