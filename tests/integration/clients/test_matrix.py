"""The client compatibility matrix (docs/clients.md): each client inside the bash-tool image.

The sandbox is started by the launcher (sandgate.sandbox.launcher) exactly as an agent host
starts one: the image as built by sandbox_images/build.sh, the environment the launcher gives
(proxy with a token, CA variables), nothing set by hand in a cell unless the docs' table says
the user must set it (an index URL, a registry address). Sandgate runs on the host at the
sandbox network's gateway; the package servers (registries.py) listen on host loopback
127.0.18.2:443 and Sandgate reaches them by --resolve.

Each cell asserts the client succeeds and, for each way Sandgate refuses, what the client
prints: a policy refusal (403 `no_rule`, inside the intercepted tunnel) and a refused proxy
credential (407 at the CONNECT).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandgate.sandbox import Sandbox, SandboxSpec
from tests.integration.clients.registries import (
    DOMAIN,
    FILE_BODY,
    GO_MODULE,
    NAMES,
    Registries,
)
from tests.integration.conftest import Proxy, start_proxy, stop_proxy
from tests.integration.docker.conftest import SESSION, TEST_LABEL
from tests.support.pki import make_pki
from tests.support.secrets import assert_no_secret

POLICIES = Path(__file__).parent / "policies"
SERVER_IP = "127.0.18.2"
GIT_PASSWORD = "test-git-REAL-password-5c1d9e"  # an obvious fake; no sandbox output may carry it
FILES = f"https://files.{DOMAIN}/hello.txt"
FORBIDDEN = f"https://forbidden.{DOMAIN}"  # resolves like the others; no rule allows it
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
              "all_proxy", "npm_config_proxy", "npm_config_https_proxy")


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registries]:
    tmp = tmp_path_factory.mktemp("clients")
    pki = make_pki(tmp / "pki", NAMES)
    reg = Registries(tmp / "srv", GIT_PASSWORD, pki)
    reg.build()
    server = reg.serve(SERVER_IP, 443, pki.cert, pki.key)
    yield reg
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def gate(tmp_path_factory, vault, registries, sandbox_network) -> Iterator[Proxy]:
    vault.put_kv2("clients/git", {"password": GIT_PASSWORD})
    p = start_proxy(tmp_path_factory.mktemp("gate"), POLICIES,
                    {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token},
                    registries.pki, "--docker-network", sandbox_network.name,
                    *[f"--resolve={n}={SERVER_IP}" for n in NAMES],
                    listen_host=sandbox_network.gateway)
    yield p
    stop_proxy(p)
    assert_no_secret([p.logs(), p.audit_file.read_text()], [GIT_PASSWORD], "the proxy logs")


@pytest.fixture(scope="module")
def tool(docker_client, gate: Proxy) -> Iterator[Sandbox]:
    spec = SandboxSpec(identity="bash-tool", proxy_url=gate.url, ca_pem=gate.ca.read_text(),
                       token=gate.token("bash-tool"), labels={TEST_LABEL: SESSION})
    with Sandbox.create(docker_client, spec) as sbx:
        yield sbx


@pytest.fixture
def sh(tool: Sandbox, gate: Proxy):
    """Run a bash command in the sandbox; `bad_token=True` swaps the proxy token for a forged
    one in every proxy variable (Sandgate answers the CONNECT with 407)."""

    def run(cmd: str, *, bad_token: bool = False, timeout: float = 120):
        env = None
        if bad_token:
            bad = f"http://bash-tool:sg1.forged.token@{gate.host}:{gate.port}"
            env = dict.fromkeys(PROXY_VARS, bad)
        res = tool.exec(cmd, timeout=timeout, env=env)
        out = res.stdout + res.stderr
        print(f"$ {cmd}\n[exit {res.exit_code}]\n{out[-3000:]}")
        assert_no_secret([out], [GIT_PASSWORD], "the sandbox output")
        return res.exit_code, out

    return run


# --- curl, wget ----------------------------------------------------------------------------------

def test_curl(sh, gate):
    code, out = sh(f"curl -sS {FILES}")
    assert code == 0 and out == FILE_BODY.decode()
    code, out = sh(f"curl -sS -w '\\n%{{http_code}}' {FORBIDDEN}/x")
    body, _, status = out.strip().rpartition("\n")
    assert status == "403" and json.loads(body)["code"] == "no_rule"
    code, out = sh(f"curl -sS {FILES}", bad_token=True)
    assert code == 56 and "CONNECT tunnel failed, response 407" in out


def test_wget(sh, gate):
    code, out = sh(f"wget -q -O - {FILES}")
    assert code == 0 and out == FILE_BODY.decode()
    code, out = sh(f"wget -O - {FORBIDDEN}/x")
    assert code == 8 and "ERROR 403: Forbidden" in out
    code, out = sh(f"wget -q --content-on-error -O - {FORBIDDEN}/x")
    assert code == 8 and json.loads(out)["code"] == "no_rule"
    code, out = sh(f"wget -O - {FILES}", bad_token=True)
    assert code == 4 and "Proxy tunneling failed: Proxy Authentication Required" in out


# --- Python ---------------------------------------------------------------------------------------

PY_CLIENTS = {
    "urllib": """
import urllib.request, urllib.error, sys
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=30)
    print(r.status, r.read().decode(), end="")
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
""",
    "requests": """
import requests, sys
r = requests.get(sys.argv[1], timeout=30)
print(r.status_code, r.text, end="")
""",
    "httpx": """
import httpx, sys
r = httpx.get(sys.argv[1], timeout=30)
print(r.status_code, r.text, end="")
""",
    "aiohttp": """
import aiohttp, asyncio, sys
async def main():
    # without trust_env aiohttp reads no proxy variable
    async with aiohttp.ClientSession(trust_env=True) as s:
        async with s.get(sys.argv[1]) as r:
            print(r.status, await r.text(), end="")
asyncio.run(main())
""",
}


@pytest.mark.parametrize("client", list(PY_CLIENTS))
def test_python_http_clients(sh, gate, client):
    script = shlex.quote(PY_CLIENTS[client])
    code, out = sh(f"python -c {script} {FILES}")
    assert code == 0 and out == f"200 {FILE_BODY.decode()}"
    code, out = sh(f"python -c {script} {FORBIDDEN}/x")
    status, _, body = out.strip().partition(" ")
    assert status == "403" and json.loads(body)["code"] == "no_rule", out
    code, out = sh(f"python -c {script} {FILES}", bad_token=True)
    assert code != 0 and "407" in out


def test_pip(sh, gate):
    index = f"https://pypi.{DOMAIN}/simple/"
    code, out = sh(f"pip install --no-cache-dir --index-url {index} sgdemo"
                   " && python -c 'import sgdemo; print(sgdemo.MESSAGE)'")
    assert code == 0 and "sgdemo imported" in out
    # pip reports a refused index page only at -vv; by default: "No matching distribution"
    cmd = f"pip download --no-cache-dir -d /tmp/pipdl --index-url {FORBIDDEN}/simple/ sgdemo"
    code, out = sh(cmd)
    assert code == 1 and "No matching distribution found for sgdemo" in out and "403" not in out
    code, out = sh(f"{cmd} -vv 2>&1 | grep -F 'Could not fetch URL'")
    assert (f"Could not fetch URL {FORBIDDEN}/simple/sgdemo/: 403 Client Error: Forbidden"
            in out)
    # a refused proxy credential is just as silent
    cmd = f"pip download --no-cache-dir -d /tmp/pipdl --retries 0 --index-url {index} sgdemo"
    code, out = sh(cmd, bad_token=True)
    assert code == 1 and "No matching distribution found for sgdemo" in out and "407" not in out
    code, out = sh(f"{cmd} -vv 2>&1 | grep -F 'Could not fetch URL'", bad_token=True)
    assert "Tunnel connection failed: 407 Proxy Authentication Required" in out


def test_uv(sh, gate):
    index = f"https://pypi.{DOMAIN}/simple/"
    code, out = sh(f"uv venv -q /tmp/uvv && VIRTUAL_ENV=/tmp/uvv uv pip install --no-cache "
                   f"--index-url {index} sgdemo && /tmp/uvv/bin/python -c "
                   "'import sgdemo; print(sgdemo.MESSAGE)'")
    assert code == 0 and "sgdemo imported" in out
    code, out = sh(f"VIRTUAL_ENV=/tmp/uvv uv pip install --no-cache --reinstall "
                   f"--index-url {FORBIDDEN}/simple/ sgdemo")
    assert code == 1 and f"An index ({FORBIDDEN}/simple/) returned a 403 Forbidden error" in out
    code, out = sh(f"VIRTUAL_ENV=/tmp/uvv uv pip install --no-cache --reinstall "
                   f"--index-url {index} sgdemo", bad_token=True)
    assert code == 2 and "tunnel error: proxy authorization required" in out


# --- Node -----------------------------------------------------------------------------------------

def test_npm_install(sh, gate):
    registry = f"https://npm.{DOMAIN}/"
    code, out = sh(f"mkdir -p /tmp/npmp && cd /tmp/npmp && npm install --no-audit --no-fund "
                   f"--registry {registry} sgdemo && node -e 'console.log(require(\"sgdemo\"))'")
    assert code == 0 and "sgdemo required" in out
    code, out = sh(f"cd /tmp/npmp && npm install --no-audit --no-fund --registry "
                   f"{FORBIDDEN}/ sgdemo@1.0.0 --prefer-online --cache /tmp/npm-cache-2")
    assert code != 0 and "403" in out
    # A new project and an empty cache: npm must ask the registry (in /tmp/npmp, which already
    # holds sgdemo@1.0.0, npm 9 answers "up to date" without a request that could be refused).
    code, out = sh(f"mkdir -p /tmp/npm407 && cd /tmp/npm407 && npm install --no-audit "
                   f"--no-fund --fetch-retries=0 --registry {registry} sgdemo@1.0.0 "
                   f"--cache /tmp/npm-cache-3", bad_token=True)
    assert code != 0 and "407 Proxy Authentication Required" in out
    # npm sends the proxy credential: with none, Sandgate would know this sandbox by its Docker
    # label and let the request through (Debian 13's npm sent none: sandbox_images/bash-tool/
    # npm-proxy-auth.js); a forged one must be what it refuses.
    assert gate.wait_audit(lambda e: e.get("code") == "auth_invalid"
                           and e.get("host") == f"npm.{DOMAIN}")


NODE_HTTPS = r"""
// Node's https module has no proxy support before Node 24: tunnel through the CONNECT the
// proxy URL names (what an agent such as https-proxy-agent does). The Sandgate CA is trusted
// from NODE_EXTRA_CA_CERTS.
const http = require('http'), https = require('https');
const proxy = new URL(process.env.HTTPS_PROXY), target = new URL(process.argv[1]);
const auth = Buffer.from(decodeURIComponent(proxy.username) + ':' +
                         decodeURIComponent(proxy.password)).toString('base64');
http.request({host: proxy.hostname, port: proxy.port, method: 'CONNECT',
              path: target.host + ':443', headers: {'Proxy-Authorization': 'Basic ' + auth}})
  .on('connect', (res, socket) => {
    if (res.statusCode !== 200) { console.log('CONNECT', res.statusCode); process.exit(2); }
    https.get({host: target.host, path: target.pathname, socket, agent: false}, (r) => {
      let body = ''; r.on('data', (d) => body += d);
      r.on('end', () => console.log(r.statusCode, body));
    }).on('error', (e) => { console.log('ERR', e.code || e.message); process.exit(3); });
  }).on('error', (e) => { console.log('ERR', e.code); process.exit(4); }).end();
"""


def test_node_https_module(sh, gate):
    script = shlex.quote(NODE_HTTPS)
    code, out = sh(f"node -e {script} {FILES}")
    assert code == 0 and out.strip() == f"200 {FILE_BODY.decode().strip()}"
    code, out = sh(f"node -e {script} {FORBIDDEN}/x")
    status, _, body = out.strip().partition(" ")
    assert status == "403" and json.loads(body)["code"] == "no_rule"
    code, out = sh(f"node -e {script} {FILES}", bad_token=True)
    assert code == 2 and out.strip() == "CONNECT 407"


NODE_FETCH = r"""
fetch(process.argv[1]).then(async (r) => console.log(r.status, await r.text()))
  .catch((e) => {
    console.log('ERR', e.message, (e.cause && e.cause.code) || ''); process.exit(3);
  });
"""


def test_node_fetch_is_a_documented_limitation(sh, gate):
    """Node 18's fetch() ignores the proxy variables (NODE_USE_ENV_PROXY needs Node 24): it dials
    directly. The sandbox network has no DNS for outside names and nothing answers but the
    proxy, so it fails with undici's connect timeout (10 s) instead of reaching anything. The
    documented workaround is the proxy agent of the `https` cell above, or gateway mode."""
    code, out = sh("node --version")
    assert int(out.strip().lstrip("v").split(".")[0]) < 24, "NODE_USE_ENV_PROXY applies: test it"
    code, out = sh(f"node -e {shlex.quote(NODE_FETCH)} {FILES}", timeout=60)
    assert code == 3 and re.search(
        r"ERR fetch failed (UND_ERR_CONNECT_TIMEOUT|EAI_AGAIN|ENOTFOUND)", out), out


# --- git ------------------------------------------------------------------------------------------

GIT = "git -c user.name=sandbox -c user.email=sandbox@example.invalid"


def test_git_clone_fetch_push(sh, gate, registries):
    base = f"https://git.{DOMAIN}"
    code, out = sh(f"rm -rf /tmp/g && mkdir /tmp/g && cd /tmp/g && git clone -q "
                   f"{base}/readonly.git && cat readonly/README "
                   "&& git -C readonly fetch -q origin && echo fetched")
    assert code == 0 and "cloned through Sandgate" in out and "fetched" in out
    seen = [s for s in registries.seen if s.host == f"git.{DOMAIN}"]
    assert seen and all(s.authorization and s.authorization.startswith("Basic ") for s in seen)
    # push where no rule allows git-receive-pack
    code, out = sh(f"cd /tmp/g/readonly && echo x > x && git add x && {GIT} commit -qm refused "
                   "&& git push origin HEAD:main")
    assert code != 0 and "The requested URL returned error: 403" in out
    assert registries.git_log("readonly.git").splitlines() == ["first"]
    ev = gate.wait_audit(lambda e: e.get("code") == "no_rule" and e.get("host") == f"git.{DOMAIN}"
                         and e.get("path", "").startswith("/readonly.git/info/refs?"))
    assert ev["decision"] == "deny"  # the audit keeps service= (a rule constrains it)
    # push where a rule allows it
    code, out = sh(f"cd /tmp/g && git clone -q {base}/pushable.git && cd pushable && echo y > y "
                   f"&& git add y && {GIT} commit -qm pushed && git push -q origin HEAD:main "
                   "&& echo pushed-ok")
    assert code == 0 and "pushed-ok" in out
    assert registries.git_log("pushable.git").splitlines() == ["pushed", "first"]
    # git (libcurl with CURLAUTH_ANY) sends proxy credentials only when challenged, and
    # Sandgate knows this container by its label: a forged token is never presented
    code, out = sh(f"git ls-remote {base}/readonly.git", bad_token=True)
    assert code == 0 and "refs/heads/main" in out
    # presented (http.proxyAuthMethod=basic sends them at once), it is refused
    code, out = sh(f"git -c http.proxyAuthMethod=basic ls-remote {base}/readonly.git",
                   bad_token=True)
    assert code != 0 and "CONNECT tunnel failed, response 407" in out


# --- Go, cargo ------------------------------------------------------------------------------------

GO_ENV = "GOFLAGS=-modcacherw GOSUMDB=off"


def test_go_mod_download(sh, gate):
    code, out = sh(f"rm -rf /tmp/gom && mkdir /tmp/gom && cd /tmp/gom && go mod init example.com/m "
                   f"2>/dev/null && GOPROXY=https://go.{DOMAIN} {GO_ENV} go mod download -json "
                   f"{GO_MODULE}@v1.0.0")
    assert code == 0 and json.loads(out)["Version"] == "v1.0.0"
    code, out = sh(f"cd /tmp/gom && GOPROXY={FORBIDDEN} {GO_ENV} go mod download -json "
                   f"{GO_MODULE}@v1.0.1")
    assert code != 0 and "403 Forbidden" in out
    code, out = sh(f"cd /tmp/gom && GOPROXY=https://go.{DOMAIN} {GO_ENV} go mod download -json "
                   f"{GO_MODULE}@v1.0.2", bad_token=True)
    assert code != 0 and "Proxy Authentication Required" in out


CARGO_PROJECT = """
rm -rf /tmp/crate && mkdir -p /tmp/crate/src /tmp/crate/.cargo && cd /tmp/crate
printf '[package]\\nname = "m"\\nversion = "0.1.0"\\nedition = "2021"\\n' > Cargo.toml
printf '\\n[dependencies]\\nsgcrate = "1"\\n' >> Cargo.toml
touch src/lib.rs
printf '[source.crates-io]\\nreplace-with = "local"\\n\\n' > .cargo/config.toml
printf '[source.local]\\nregistry = "sparse+%s/index/"\\n' "$INDEX" >> .cargo/config.toml
"""


def test_cargo_sparse_registry(sh, gate):
    code, out = sh(f"INDEX=https://crates.{DOMAIN}; {CARGO_PROJECT} cargo fetch && "
                   "ls ~/.cargo/registry/cache/*/")
    assert code == 0 and "sgcrate-1.0.0.crate" in out
    code, out = sh(f"INDEX={FORBIDDEN}; {CARGO_PROJECT} CARGO_NET_RETRY=0 cargo fetch")
    assert code != 0 and "403" in out
    code, out = sh(f"INDEX=https://crates.{DOMAIN}; {CARGO_PROJECT} rm -rf ~/.cargo/registry; "
                   "CARGO_NET_RETRY=0 cargo fetch", bad_token=True)
    assert code != 0 and "407" in out
