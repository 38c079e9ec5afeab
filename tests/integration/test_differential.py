"""`explain` says exactly what the proxy does: a differential test with zero disagreements.

A fleet policy using every construct (tests/integration/policies_differential: passthrough
exact and wildcard, templates, query rules with optional and absent parameters, gateways,
per-sandbox secrets, report mode, deny rules, pseudo-TLD denies, `public: true`, private_cidrs,
IP literals, an internal address) is served by a running `sandgate run` (real OpenBao, real TLS
upstreams on loopback). A few hundred requests, generated from a fixed seed, go through it as
clients send them: https through a real CONNECT tunnel and TLS, plain http in absolute form,
gateway paths to the gateway listener, with and without a sandbox id in the token. What the
proxy did is observed from outside: its refusal (X-Sandgate-Reason), a tunnel (the upstream's
own certificate reached the client), or the request the upstream received (which credentials
it carried) and the proxy's audit decision (allow or report). The same requests are judged by
`sandgate explain --batch` (with --sandbox and --gateway where they apply, and the proxy's
--resolve pins). Every request must come out the same.

Addresses: 127.0.47.0/24 (the upstreams at .2 on ports 443, 8443 and 80; the gateway at .1), and
a public address, 192.175.48.47 (AS112), on a test host of our own in a network namespace
(tests/support/netns.py): what `public: true` and report mode may reach. Run it in its own
network namespace, like every integration test.
"""

from __future__ import annotations

import base64
import json
import random
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from tests.integration.conftest import (
    HERE,
    SANDGATE,
    Proxy,
    free_port,
    start_proxy,
    stop_proxy,
)
from tests.support.netns import host_in_netns, listen_in_netns
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret
from tests.support.upstream import Seen, UpstreamServer

pytestmark = pytest.mark.integration

POLICIES = HERE / "policies_differential"
UPSTREAM_IP = "127.0.47.2"
GATEWAY_IP = "127.0.47.1"
PUBLIC_IP = "192.175.48.47"
NAMES = ["api.dt.test", "git.dt.test", "gh.dt.test", "files.dt.test", "plain.dt.test",
         "tunnel.dt.test", "*.pt.dt.test", "*.x.pt.dt.test", "web.dt.test", "nothing.dt.test",
         "wiki.corp.internal", "pub.dt.test"]
PINNED = ["api.dt.test", "git.dt.test", "gh.dt.test", "files.dt.test", "plain.dt.test",
          "tunnel.dt.test", "a.pt.dt.test", "b.x.pt.dt.test", "web.dt.test", "nothing.dt.test",
          "wiki.corp.internal"]
RESOLVE = [f"--resolve={n}={UPSTREAM_IP}" for n in PINNED] + [
    "--resolve=meta.dt.test=169.254.169.254", f"--resolve=pub.dt.test={PUBLIC_IP}"]
# Obvious fakes, stored in OpenBao; the upstream tells which of them a request carried.
LLM_KEY = "dt-llm-REAL-value-47a1"
GIT_TOKEN = "dt-git-REAL-value-47b2"
GH_TOKEN = "dt-gh-REAL-value-47c3"
SECRETS = {"llm": LLM_KEY, "git": GIT_TOKEN, "gh": GH_TOKEN}
IDENTITIES = ["coding-agent", "web-fetch", "audit-bot", "bash-tool"]
SANDBOXES: list[str | None] = [None, "sb-1"]


@dataclass
class Req:
    n: int
    identity: str
    sandbox: str | None
    method: str
    url: str  # absolute URL, or a gateway path when gateway
    gateway: bool = False

    @property
    def tagged(self) -> str:
        """The URL with a query parameter naming the request (the audit keeps names)."""
        sep = "&" if "?" in self.url else "?"
        return f"{self.url}{sep}dtid{self.n}=1"


@dataclass(frozen=True)
class Outcome:
    decision: str  # allow / deny / report / tunnel
    code: str | None  # deny and report: why
    secrets: tuple[str, ...]  # allow: the credentials the request carried (by name)

    def __str__(self) -> str:
        return f"{self.decision} {self.code or ''} {','.join(self.secrets)}".strip()


# --- the requests ---------------------------------------------------------------------------

HOSTS = ["api.dt.test", "git.dt.test", "gh.dt.test", "files.dt.test", "files.dt.test:8443",
         "tunnel.dt.test", "tunnel.dt.test:8443", "a.pt.dt.test", "b.x.pt.dt.test",
         "web.dt.test", "meta.dt.test", "nothing.dt.test", "wiki.corp.internal", UPSTREAM_IP,
         "pub.dt.test"]
METHODS = ["GET", "GET", "POST", "DELETE", "HEAD"]
PATHS = ["/", "/v1/messages", "/user", "/repos/acme/x", "/repos/acme/info/refs",
         "/repos/acme/git-upload-pack", "/admin/x", "/docs/a", "/ip/a", "/repos/acme-evil/x"]
QUERIES = ["", "", "?service=git-upload-pack", "?service=git-receive-pack", "?page=1",
           "?page=3", "?debug=1", "?page=1&page=2"]
PLAIN = ["http://plain.dt.test/x", "http://tunnel.dt.test/", "http://files.dt.test/",
         "http://plain.dt.test/y?page=1"]
GATEWAY_PATHS = [("POST", "/llm/v1/messages"), ("GET", "/llm/v1/messages"),
                 ("POST", "/llm/v1/other"), ("GET", "/tun/x"), ("GET", "/files/docs/a"),
                 ("GET", "/files/admin/x"), ("GET", "/files/x?debug=1"),
                 ("HEAD", "/files/x?page=2")]
# Every found case is in, whatever the sample: tunnels (exact and wildcard, any method), the
# sandbox, gateways.
MUST = [("coding-agent", s, m, u) for s in SANDBOXES for m, u in [
    ("GET", "https://tunnel.dt.test/"), ("POST", "https://tunnel.dt.test/x"),
    ("DELETE", "https://tunnel.dt.test/a/b?c=1"), ("GET", "https://a.pt.dt.test/"),
    ("PATCH", "https://b.x.pt.dt.test/admin"), ("GET", "https://gh.dt.test/user"),
    ("GET", "https://gh.dt.test/repos/acme/x"), ("POST", "https://api.dt.test/v1/messages"),
    ("GET", "https://git.dt.test/repos/acme/info/refs?service=git-upload-pack")]] + [
    (i, None, "GET", "https://pub.dt.test/x") for i in IDENTITIES]


def requests() -> list[Req]:
    rnd = random.Random(4747)
    out: list[Req] = []

    def add(identity: str, sandbox: str | None, method: str, url: str,
            gateway: bool = False) -> None:
        out.append(Req(len(out), identity, sandbox, method, url, gateway))

    for identity, sandbox, method, url in MUST:
        add(identity, sandbox, method, url)
    for _ in range(300):
        add(rnd.choice(IDENTITIES), rnd.choice(SANDBOXES), rnd.choice(METHODS),
            f"https://{rnd.choice(HOSTS)}{rnd.choice(PATHS)}{rnd.choice(QUERIES)}")
    for identity in IDENTITIES:
        for url in PLAIN:
            add(identity, None, "GET", url)
        for sandbox in SANDBOXES:
            for method, path in GATEWAY_PATHS:
                add(identity, sandbox, method, path, gateway=True)
    return out


# --- the proxy ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dt_pki(tmp_path_factory: pytest.TempPathFactory):
    return make_pki(tmp_path_factory.mktemp("dt-pki"), NAMES, [UPSTREAM_IP])


@pytest.fixture(scope="module")
def upstreams(dt_pki, public_upstream) -> Iterator[list[UpstreamServer]]:
    cert, key = str(dt_pki.cert), str(dt_pki.key)
    servers = [public_upstream, UpstreamServer(UPSTREAM_IP, 443, cert, key).start(),
               UpstreamServer(UPSTREAM_IP, 8443, cert, key).start(),
               UpstreamServer(UPSTREAM_IP, 80, None, None).start()]
    yield servers
    for s in servers[1:]:
        s.stop()


@pytest.fixture(scope="module")
def public_upstream(dt_pki) -> Iterator[UpstreamServer]:
    with host_in_netns(PUBLIC_IP) as ns:
        sock = listen_in_netns(ns, PUBLIC_IP, 443)
        server = UpstreamServer(PUBLIC_IP, 443, str(dt_pki.cert), str(dt_pki.key),
                                sock=sock).start()
        yield server
        server.stop()


@dataclass
class Running:
    proxy: Proxy
    gateway_port: int


@pytest.fixture(scope="module")
def running(tmp_path_factory, vault, upstreams, dt_pki) -> Iterator[Running]:
    vault.put_kv2("dt/llm", {"api_key": LLM_KEY})
    vault.put_kv2("dt/git", {"token": GIT_TOKEN})
    vault.put_kv2("dt/sandboxes/sb-1/gh", {"token": GH_TOKEN})
    tmp = tmp_path_factory.mktemp("dt")
    gw_port = free_port()
    p = start_proxy(tmp, POLICIES, {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token},
                    dt_pki, f"--gateway={GATEWAY_IP}:{gw_port}", *RESOLVE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection((GATEWAY_IP, gw_port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    yield Running(p, gw_port)
    stop_proxy(p)
    logs = p.logs() + (p.audit_file.read_text() if p.audit_file.exists() else "")
    assert_no_secret([logs], tuple(SECRETS.values()), "the proxy's logs or audit")


class Tokens:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.cache: dict[tuple[str, str | None], str] = {}

    def __call__(self, identity: str, sandbox: str | None) -> str:
        key = (identity, sandbox)
        if key not in self.cache:
            self.cache[key] = self.proxy.token(identity, sandbox=sandbox)
        return self.cache[key]


def _recv_all(s: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionResetError, ssl.SSLError):
            break
        if not chunk:
            break
        data += chunk
    return data


def _head(raw: bytes) -> tuple[int, dict[str, str]]:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    parts = head[0].split(" ")
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {}
    for line in head[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


def _request_bytes(method: str, target: str, host: str, extra: dict[str, str]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close",
             "Content-Length: 0", *(f"{k}: {v}" for k, v in extra.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass
class Sent:
    status: int
    headers: dict[str, str]
    tunnelled: bool  # the upstream's own certificate reached the client


def send(run: Running, tokens: Tokens, r: Req) -> Sent:
    deadline = time.monotonic() + 15
    token = tokens(r.identity, r.sandbox)
    auth = "Basic " + base64.b64encode(f"{r.identity}:{token}".encode()).decode()
    if r.gateway:
        s = socket.create_connection((GATEWAY_IP, run.gateway_port), timeout=10)
        with s:
            s.sendall(_request_bytes(r.method, r.tagged, f"{GATEWAY_IP}:{run.gateway_port}",
                                     {"x-api-key": token}))
            return Sent(*_head(_recv_all(s, deadline)), False)
    scheme, _, rest = r.url.partition("://")
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    host = authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority
    port = int(authority.rsplit(":", 1)[1]) if authority.count(":") == 1 else (
        443 if scheme == "https" else 80)
    s = socket.create_connection((run.proxy.host, run.proxy.port), timeout=10)
    with s:
        if scheme == "http":
            s.sendall(_request_bytes(r.method, r.tagged, authority,
                                     {"Proxy-Authorization": auth}))
            return Sent(*_head(_recv_all(s, deadline)), False)
        s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                  f"Proxy-Authorization: {auth}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head and time.monotonic() < deadline:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        status, headers = _head(head)
        if status != 200:
            return Sent(status, headers, False)
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the issuer tells interception from a tunnel
        ip_host = host.replace(".", "").isdigit()
        with ctx.wrap_socket(s, server_hostname=None if ip_host else host) as t:
            der = t.getpeercert(binary_form=True)
            assert der is not None
            issuer = x509.load_der_x509_certificate(der).issuer
            cn = issuer.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
            tunnelled = cn == "sandgate test upstream CA"
            path = r.tagged.split(authority, 1)[1] or "/"
            t.sendall(_request_bytes(r.method, path, authority if port != 443 else host, {}))
            return Sent(*_head(_recv_all(t, deadline)), tunnelled)


def carried(seen: Seen) -> tuple[str, ...]:
    """The secrets a request arrived upstream with (as sent: raw, or in Basic auth)."""
    blob = " ".join(seen.headers.values()) + " " + seen.query
    for v in list(seen.headers.values()):
        if v.lower().startswith("basic "):
            try:
                blob += " " + base64.b64decode(v[6:]).decode("utf-8", "replace")
            except ValueError:
                pass
    return tuple(sorted(n for n, v in SECRETS.items() if v in blob))


def observed(run: Running, upstreams: list[UpstreamServer], reqs: list[Req],
             sent: dict[int, Sent]) -> dict[int, Outcome]:
    time.sleep(0.5)  # the last audit events
    audit: dict[int, dict] = {}
    for ev in run.proxy.audit():
        path = ev.get("path") or ""
        for part in path.partition("?")[2].split("&"):
            name = part.partition("=")[0]
            if name.startswith("dtid") and name[4:].isdigit() and ev.get("event") == "request":
                audit[int(name[4:])] = ev
    seen: dict[int, Seen] = {}
    for server in upstreams:
        for s in server.upstream.seen:
            for part in s.query.split("&"):
                name = part.partition("=")[0]
                if name.startswith("dtid") and name[4:].isdigit():
                    seen[int(name[4:])] = s
    out: dict[int, Outcome] = {}
    for r in reqs:
        got = sent[r.n]
        reason = got.headers.get("x-sandgate-reason")
        if reason is not None:
            out[r.n] = Outcome("deny", reason, ())
        elif got.tunnelled and r.n in seen:
            out[r.n] = Outcome("tunnel", None, ())
        elif r.n in seen and r.n in audit:
            ev = audit[r.n]
            if ev["decision"] == "report":
                out[r.n] = Outcome("report", ev.get("code"), carried(seen[r.n]))
            else:
                out[r.n] = Outcome(ev["decision"], None, carried(seen[r.n]))
        else:
            out[r.n] = Outcome("unobserved", f"status {got.status}", ())
    return out


# --- explain --batch ------------------------------------------------------------------------


def explained(reqs: list[Req], tmp: Path) -> dict[int, Outcome]:
    out: dict[int, Outcome] = {}
    groups: dict[tuple[str | None, bool], list[Req]] = {}
    for r in reqs:
        groups.setdefault((r.sandbox, r.gateway), []).append(r)
    for (sandbox, gateway), group in groups.items():
        batch = tmp / f"batch-{sandbox}-{gateway}.txt"
        batch.write_text("".join(f"{r.identity} {r.method} {r.tagged}\n" for r in group))
        cmd = [*SANDGATE, "explain", "--policies", str(POLICIES), "--batch", str(batch),
               *RESOLVE]
        if sandbox is not None:
            cmd += ["--sandbox", sandbox]
        if gateway:
            cmd.append("--gateway")
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        docs = [json.loads(line) for line in res.stdout.splitlines()]
        assert len(docs) == len(group), res.stderr
        for r, doc in zip(group, docs, strict=True):
            assert "error" not in doc, doc
            decision = doc["decision"]
            secrets: tuple[str, ...] = ()
            if decision == "allow":
                secrets = tuple(sorted(doc.get("placeholders_honoured") or ()))
            code = doc["code"] if decision in ("deny", "report") else None
            out[r.n] = Outcome(decision, code, secrets)
    return out


def test_explain_agrees_with_the_running_proxy(running, upstreams, tmp_path):
    reqs = requests()
    assert len(reqs) > 300
    tokens = Tokens(running.proxy)
    sent = {r.n: send(running, tokens, r) for r in reqs}
    proxy = observed(running, upstreams, reqs, sent)
    model = explained(reqs, tmp_path)
    disagreements = [f"#{r.n} {r.identity} sandbox={r.sandbox} "
                     f"{'gateway ' if r.gateway else ''}{r.method} {r.url}: explain says "
                     f"{model[r.n]}, the proxy did {proxy[r.n]}"
                     for r in reqs if model[r.n] != proxy[r.n]]
    assert not disagreements, f"{len(disagreements)} of {len(reqs)}:\n" + "\n".join(
        disagreements)
    # The sample covers every outcome the model has (a test that cannot fail proves nothing).
    kinds = {o.decision for o in proxy.values()}
    codes = {o.code for o in proxy.values() if o.decision == "deny"}
    assert kinds == {"allow", "deny", "report", "tunnel"}, kinds
    assert {"no_rule", "denied_by_rule", "internal_address", "sandbox_required"} <= codes
    assert {s for o in proxy.values() for s in o.secrets} == set(SECRETS)


def test_the_policy_checks_and_lints_clean():
    for args in (["check", *RESOLVE], ["lint", "--strict"]):
        res = subprocess.run([*SANDGATE, *args, str(POLICIES)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
