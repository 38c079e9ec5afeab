"""Real parts for the soak and fault tests, on their own loopback addresses (127.0.12.0/24).

  127.0.12.1        the proxies under test listen here
  127.0.12.2:443    `Recorder` TLS upstream (api/bearer/open/cold*.soak.test), :80 plain
  127.0.12.4-.7     broken TLS upstreams (test_faults.py)
  127.0.12.30       a listener that never accepts (test_limits.py, not a soak test)

OpenBao is a dev server with a fixed root token and a fixed AppRole (role id and secret id set
by the seed), so a restarted server, seeded again, accepts the proxy's AppRole login again: what
an operator's real Vault does after a restart, and what makes the proxy log in afresh.
"""

from __future__ import annotations

import os
import resource
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import hvac.exceptions
import pytest

from tests.integration.conftest import SANDGATE, Proxy, start_proxy, stop_proxy
from tests.support.bao import SeedableVault
from tests.support.pki import Pki, make_pki
from tests.support.recorder import Recorder
from tests.support.secrets import assert_no_secret

UPSTREAM = "127.0.12.2"
LISTEN = "127.0.12.1"
IDENTITIES = ("agent-a", "agent-b", "agent-c", "agent-d")
COLD = ("cold1", "cold2")  # secrets first needed while OpenBao is down (test_vault_outage.py)
NAMES = ["api.soak.test", "*.soak.test"]
RESOLVE = {
    **{n: UPSTREAM for n in ("api.soak.test", "bearer.soak.test", "open.soak.test",
                             "cold1.soak.test", "cold2.soak.test")},
    "inside.soak.test": "10.12.0.1",  # refused by address: the rules name no private range
    "loop.soak.test": "127.0.12.9",
    "wrong.other.test": "127.0.12.4",  # serves the *.soak.test certificate
    "untrusted.soak.test": "127.0.12.5",
    "plaintls.soak.test": "127.0.12.6",
    "hangup.soak.test": "127.0.12.7",
}
ROLE = "sandgate-soak"
# Obvious fakes, made per run: what the upstream must see and nothing else may contain.
SECRET_VALUES: dict[str, str] = {
    **{f"key_{i[-1]}": f"soak-key-{i[-1]}-REAL-{secrets.token_hex(8)}" for i in IDENTITIES},
    **{f"tok_{i[-1]}": f"soak-tok-{i[-1]}-REAL-{secrets.token_hex(8)}" for i in IDENTITIES},
    **{c: f"soak-{c}-REAL-{secrets.token_hex(8)}" for c in COLD},
}
ROLE_ID = f"soak-role-{secrets.token_hex(6)}"
SECRET_ID = f"soak-secret-id-{secrets.token_hex(12)}"


def placeholder(secret: str) -> str:
    return f"sandgate-placeholder-{secret.replace('_', '-')}"


def policy_yaml() -> str:
    lines = ["version: v1", "secrets:"]
    for name in SECRET_VALUES:
        lines.append(f"  {name}: {{vault: secret/data/soak/{name}, field: value, "
                     f"placeholder: {placeholder(name)}}}")
    lines.append("identities:")
    for ident in IDENTITIES:
        s = ident[-1]
        lines += [
            f"  {ident}:",
            "    rules:",
            "      - name: api",
            "        hosts: [api.soak.test]",
            "        methods: [POST]",
            "        paths: [/v1/**, /echo/**, /reset-early/**, /reset-head/**, /reset-body/**,"
            " /reset-stream/**, /silent/**]",
            f"        inject: {{headers: {{x-api-key: \"{{{{ secrets.key_{s} }}}}\"}}}}",
            f"        private_cidrs: [{UPSTREAM}/32]",
            "      - name: bearer",
            "        hosts: [bearer.soak.test]",
            "        methods: [POST]",
            "        paths: [/v1/**, /echo/**]",
            f"        inject: {{headers: {{authorization: \"Bearer {{{{ secrets.tok_{s} }}}}\"}}}}",
            f"        private_cidrs: [{UPSTREAM}/32]",
            "      - name: open",
            "        schemes: [https, http]",
            "        hosts: [open.soak.test]",
            "        methods: [GET]",
            "        paths: [/pub/**]",
            f"        private_cidrs: [{UPSTREAM}/32]",
            "      - name: no-admin",
            "        action: deny",
            "        hosts: [api.soak.test]",
            "        paths: [/admin/**]",
            "      - name: inside",
            "        hosts: [inside.soak.test, loop.soak.test]",
            "        methods: [GET]",
            "      - name: broken-tls",
            "        hosts: [wrong.other.test, untrusted.soak.test, plaintls.soak.test,"
            " hangup.soak.test]",
            "        methods: [POST]",
            f"        inject: {{headers: {{x-api-key: \"{{{{ secrets.key_{s} }}}}\"}}}}",
            "        private_cidrs: [127.0.12.0/24]",
        ]
        for c in COLD:
            lines += [
                f"      - name: {c}",
                f"        hosts: [{c}.soak.test]",
                "        methods: [POST]",
                "        paths: [/v1/**]",
                f"        inject: {{headers: {{x-api-key: \"{{{{ secrets.{c} }}}}\"}}}}",
                f"        private_cidrs: [{UPSTREAM}/32]",
            ]
    return "\n".join(lines) + "\n"


def seed(v: SeedableVault) -> None:
    """Secrets and the proxy's AppRole (fixed ids): run again after every restart."""
    # A fresh dev server upgrades its KV v2 mount for a moment after it reports healthy
    # ("Upgrading from non-versioned to versioned data"): writes fail until it is done.
    deadline = time.monotonic() + 15
    while True:
        try:
            v.put_kv2("soak/ready", {"value": "yes"})
            break
        except hvac.exceptions.InvalidRequest:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    for name, value in SECRET_VALUES.items():
        v.put_kv2(f"soak/{name}", {"value": value})
    c = v.client()
    if "approle/" not in c.sys.list_auth_methods()["data"]:
        c.sys.enable_auth_method("approle")
    c.sys.create_or_update_policy(name=ROLE,
                                  policy='path "secret/data/soak/*" { capabilities = ["read"] }')
    c.auth.approle.create_or_update_approle(role_name=ROLE, token_policies=[ROLE],
                                            token_ttl="1h")
    c.auth.approle.update_role_id(role_name=ROLE, role_id=ROLE_ID)
    c.auth.approle.create_custom_secret_id(role_name=ROLE, secret_id=SECRET_ID)


@pytest.fixture(scope="session", autouse=True)
def _many_fds() -> None:
    """2,000 idle connections need more than the common soft limit of 1,024 descriptors (for
    this process and for the proxy, which inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 16384) if hard != resource.RLIM_INFINITY else 16384
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@pytest.fixture(scope="session")
def soak_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("soak-pki"), NAMES)


@pytest.fixture(scope="session")
def recorder(soak_pki: Pki) -> Iterator[Recorder]:
    r = Recorder(UPSTREAM, 443, str(soak_pki.cert), str(soak_pki.key)).start()
    yield r
    r.stop()


@pytest.fixture(scope="session")
def plain_recorder() -> Iterator[Recorder]:
    r = Recorder(UPSTREAM, 80).start()
    yield r
    r.stop()


@pytest.fixture
def soak_vault() -> Iterator[SeedableVault]:
    v = SeedableVault(root_token=f"soak-root-{secrets.token_hex(8)}")
    v.start()
    try:
        seed(v)
        yield v
    finally:
        v.stop()


@dataclass
class SoakProxy:
    proxy: Proxy
    tokens: dict[str, str]

    @property
    def pid(self) -> int:
        return self.proxy.proc.pid

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def cpu_seconds(self) -> float:
        """User + system CPU time the proxy has used so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


def issue_tokens(p: Proxy) -> dict[str, str]:
    out = {}
    for ident in IDENTITIES:
        out[ident] = subprocess.run(
            [*SANDGATE, "token", "issue", "--confdir", str(p.confdir), "--identity", ident,
             "--ttl", "1h"], check=True, capture_output=True, text=True).stdout.strip()
    return out


def start_soak_proxy(tmp: Path, vault: SeedableVault, pki: Pki, *extra: str) -> SoakProxy:
    policies = tmp / "policies"
    policies.mkdir()
    (policies / "soak.yaml").write_text(policy_yaml())
    env = {"VAULT_ADDR": vault.addr, "VAULT_ROLE_ID": ROLE_ID, "VAULT_SECRET_ID": SECRET_ID,
           # small, so "no request hangs past the Vault timeout" is checked in seconds
           "VAULT_CLIENT_TIMEOUT": "1"}
    resolve = [f"--resolve={n}={ip}" for n, ip in RESOLVE.items()]
    p = start_proxy(tmp, policies, env, pki, *resolve, "--no-watch", *extra, listen_host=LISTEN)
    return SoakProxy(p, issue_tokens(p))


def finish(sp: SoakProxy) -> str:
    """Stop the proxy; check its log and audit hold no secret value. Returns the log text."""
    stop_proxy(sp.proxy)
    logs = sp.proxy.logs()
    audit = sp.proxy.audit_file.read_text() if sp.proxy.audit_file.exists() else ""
    assert_no_secret([logs, audit], [*SECRET_VALUES.values(), SECRET_ID],
                     "the proxy's log or audit")
    return logs
