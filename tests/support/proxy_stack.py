"""A running Sandgate for integration tests: `sandgate run` with OpenBao, a policy, its audit
file and the CA, started by one factory; and the helpers every proxy test shares.

`start_stack()` (and the `proxy_stack` fixture factory in tests/integration/conftest.py, which
stops what it started at the end of the module) writes the policy, seeds OpenBao, starts
`sandgate run` (one process unless asked) with the given names resolved and, if asked, its admin
listener, and gives back a `ProxyStack`: the proxy's address, tokens, a client environment, the
audit reader and the admin client. Stopping it checks that no secret value reached the proxy's
log or audit.

The side-channel and request-integrity tests (tests/integration/test_side_channels.py,
test_request_integrity.py) run their own servers; each test module imports the fixtures it uses;
they are module-scoped, so the servers of one module are gone before the next module binds the
same addresses. Addresses (127.0.0.2:80/443 belong to the shared fixtures):

    127.0.0.3:443  ws.r2.test     WsServer (aiohttp, TLS)
    127.0.0.4:443  raw.r2.test    RawServer (HTTP/1 by hand, TLS)
    127.0.0.5:443  h2.r2.test     H2TrailerServer (h2 only)
    127.0.0.6:443  nginx.r2.test  nginx, vhosts nginx.r2.test (default) and other.test
    127.0.0.7:443  up.r2.test     RawServer that switches to any Upgrade (TLS), and :80 plain
    ::ffff:0:7f00:2  x.r2.test    IPv4-translated 127.0.0.2 (nothing listens)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.admin_support import ADMIN_TOKEN, Admin, wait_for
from tests.integration.conftest import Proxy, free_port, start_proxy, stop_proxy
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


def client_env(proxy: Proxy, identity: str) -> dict[str, str]:
    """The environment of a client process in a sandbox: this process's, less every key, token
    and Vault variable, with the proxy (and a token of `identity`) and the CA for each runtime."""
    env = {k: v for k, v in os.environ.items() if "KEY" not in k and "TOKEN" not in k
           and not k.startswith("VAULT")}
    env.update({"HTTPS_PROXY": proxy.proxy_url(identity), "NO_PROXY": "",
                "SSL_CERT_FILE": str(proxy.ca), "NODE_EXTRA_CA_CERTS": str(proxy.ca)})
    return env


@dataclass
class ProxyStack:
    """A started `sandgate run`: `proxy` (address, tokens, audit reader, log), `admin` (the
    admin API client when started with `admin=True`), and what `stop()` checks."""

    proxy: Proxy
    policies: Path
    admin_client: Admin | None = None
    secrets: tuple[str, ...] = ()
    what: str = "the proxy's logs or audit"
    _stopped: bool = field(default=False, repr=False)

    @property
    def admin(self) -> Admin:
        assert self.admin_client is not None, "start the stack with admin=True"
        return self.admin_client

    @property
    def url(self) -> str:
        return self.proxy.url

    def token(self, identity: str, ttl: str = "1h", sandbox: str | None = None) -> str:
        return self.proxy.token(identity, ttl, sandbox)

    def audit(self) -> list[dict[str, Any]]:
        return self.proxy.audit()

    def wait_audit(self, pred: Callable[[dict[str, Any]], bool],
                   timeout: float = 5.0) -> dict[str, Any]:
        return self.proxy.wait_audit(pred, timeout)

    def client_env(self, identity: str) -> dict[str, str]:
        return client_env(self.proxy, identity)

    def logs_and_audit(self) -> str:
        p = self.proxy
        return p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")

    def stop(self) -> None:
        """Stop the proxy (once), then check that no secret value is in its log or audit."""
        if self._stopped:
            return
        self._stopped = True
        stop_proxy(self.proxy)
        from tests.integration.conftest import SECRET_VALUES

        assert_no_secret([self.logs_and_audit()], [*SECRET_VALUES, *self.secrets], self.what)


def start_stack(tmp: Path, vault: Any, pki: Any, *, policies: Path | None = None,
                policy: str | Mapping[str, str] | None = None,
                resolve: Mapping[str, str] | None = None, args: Sequence[str] = (),
                admin: bool = False, admin_wait: float = 15,
                admin_token_env: bool | None = None,
                env: Mapping[str, str] | None = None,
                seed: Mapping[str, Mapping[str, str]] | None = None,
                secrets: Sequence[str] = (), what: str = "the proxy's logs or audit"
                ) -> ProxyStack:
    """Start `sandgate run` in `tmp` (its confdir, audit file and log go there).

    policies: a policy directory, or policy: the text of one file (`policy.yaml`) or
    {file name: text}, written to tmp/policies. resolve: {name: address} for `--resolve`.
    args: more `sandgate run` arguments. admin: an admin listener on a free port with
    ADMIN_TOKEN (waited for, admin_wait seconds at most); admin_token_env: pass
    SANDGATE_ADMIN_TOKEN without a listener. env: more environment. seed: {KV v2 path: data}
    written to OpenBao first. secrets: more values that must not reach the log or audit (the
    shared fakes are always checked)."""
    if (policies is None) == (policy is None):
        raise ValueError("give policies (a directory) or policy (text), not both")
    if policy is not None:
        policies = tmp / "policies"
        policies.mkdir()
        files = {"policy.yaml": policy} if isinstance(policy, str) else policy
        for name, text in files.items():
            (policies / name).write_text(text)
    assert policies is not None
    for path, data in (seed or {}).items():
        vault.put_kv2(path, dict(data))
    run_env = vault_env(vault)
    if admin or admin_token_env:
        run_env["SANDGATE_ADMIN_TOKEN"] = ADMIN_TOKEN
    run_env.update(env or {})
    extra = [f"--resolve={name}={ip}" for name, ip in (resolve or {}).items()]
    admin_port = free_port() if admin else None
    if admin_port is not None:
        extra += ["--admin", f"127.0.0.1:{admin_port}"]
    p = start_proxy(tmp, policies, run_env, pki, *extra, *args)
    stack = ProxyStack(p, policies, secrets=tuple(secrets), what=what)
    if admin_port is not None:
        stack.admin_client = Admin(p, f"http://127.0.0.1:{admin_port}", policies)
        try:
            wait_for(lambda: _admin_up(stack.admin), admin_wait, "the admin listener")
        except BaseException:
            stack.stop()
            raise
    return stack


def _admin_up(admin: Admin) -> bool:
    try:
        return admin.get("/healthz", token=None, timeout=2)[0] == 200
    except OSError:
        return False


def stack_factory(tmp_path_factory: Any, vault: Any) -> Iterator[Callable[..., ProxyStack]]:
    """The body of the `proxy_stack` fixture: `proxy_stack(name, pki, **start_stack_args)`
    starts a stack in a fresh temporary directory; whatever was not stopped by the end of the
    module's tests is stopped (and checked) then."""
    started: list[ProxyStack] = []

    def start(name: str, pki: Any, **kwargs: Any) -> ProxyStack:
        stack = start_stack(tmp_path_factory.mktemp(name), vault, pki, **kwargs)
        started.append(stack)
        return stack

    yield start
    for stack in started:
        stack.stop()


def r2_proxy_running(tmp_path_factory, vault, pki) -> Iterator[Proxy]:
    """`sandgate run` with policies_channel_servers/ and the names above (a test module's fixture
    body: `yield from r2_proxy_running(...)`)."""

    stack = start_stack(tmp_path_factory.mktemp("r2proxy"), vault, pki, policies=POLICIES_R2,
                        resolve={**R2_RESOLVE}, what="the side-channel proxy's logs or audit")
    yield stack.proxy
    stack.stop()


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
