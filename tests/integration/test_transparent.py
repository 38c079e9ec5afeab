"""Transparent capture in network namespaces: clients with no proxy setting at all, in a sandbox
namespace whose packets the router (this namespace) redirects to `sandgate run --transparent`
with the table `sandgate capture` installs (real nft). Allowed hosts are reached with
the key injected; denied ones get Sandgate's readable refusal inside TLS; other ports, UDP, QUIC
and DNS to any resolver go nowhere and are counted.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sandgate.capture import nftables as capture
from tests.integration.conftest import (
    ANTHROPIC_KEY,
    HERE,
    SANDGATE,
    Proxy,
    start_proxy,
    stop_proxy,
)
from tests.support.capture import (
    NODE_CLIENT,
    PYTHON_CLIENT,
    ROUTER_IP,
    STRANGER_IP,
    SandboxNetns,
    build_go_client,
    clean_env,
    local_addresses,
    sandbox_netns,
    split,
)
from tests.support.pki import make_pki
from tests.support.upstream import UpstreamServer

pytestmark = pytest.mark.integration

UPSTREAM = "198.51.100.64"  # the allowed hosts' address (on this namespace's lo)
ELSEWHERE = "198.51.100.65"  # the denied host's address: nothing listens there
API, PLAIN, PASS, DENIED = ("api.transparent.test", "plain.transparent.test",
                            "pass.transparent.test", "denied.transparent.test")
TRANSPARENT_PORT = 8443
RAW_PORT = 2222  # a TCP service on the upstream's address the capture must not let through
UDP_PORT = 5300  # a UDP service there: nothing may arrive
ADMIN = "127.0.69.1"  # the admin listener (/metrics open): the capture counters scraped
ADMIN_PORT = 9469
HOSTS = {API: UPSTREAM, PLAIN: UPSTREAM, PASS: UPSTREAM, DENIED: ELSEWHERE}


@pytest.fixture(scope="module")
def tp_pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("tp-pki"), [API, PLAIN, PASS, DENIED])


@pytest.fixture(scope="module")
def world(tmp_path_factory, tp_pki, vault) -> Iterator[tuple[SandboxNetns, Proxy]]:
    with local_addresses([UPSTREAM]), sandbox_netns(HOSTS) as ns, \
            sandbox_netns(HOSTS, net=1) as pod:
        tls_up = UpstreamServer(UPSTREAM, 443, str(tp_pki.cert), str(tp_pki.key)).start()
        plain_up = UpstreamServer(UPSTREAM, 80, None, None).start()
        resolve = [f"--resolve={h}={ip}" for h, ip in HOSTS.items()]
        p = start_proxy(tmp_path_factory.mktemp("tp"), HERE / "policies_transparent",
                        {"VAULT_ADDR": vault.addr, "VAULT_TOKEN": vault.root_token,
                         "SANDGATE_ADMIN_TOKEN": "test-admin-token"}, tp_pki,
                        "--transparent", f"{ROUTER_IP}:{TRANSPARENT_PORT}",
                        "--identity-cidr", "10.64.0.2/32=coding-agent/tp-sandbox-1",
                        "--identity-cidr", f"{pod.ip}/32=coding-agent/tp-pod-1", *resolve,
                        "--admin", f"{ADMIN}:{ADMIN_PORT}", "--admin-open", "/metrics",
                        listen_host="127.0.64.1")
        try:
            # what `sandgate sandbox network --transparent` does for Docker's bridge
            out = subprocess.run([*SANDGATE, "capture", "--interface", ns.router_if,
                                  "--transparent", str(TRANSPARENT_PORT)],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            # a pod: the init container's table inside the sandbox's own namespace (no router
            # table on its link): DNAT to Sandgate's listener, which then sees no original
            # destination and judges the name alone
            out = pod.run(*SANDGATE, "capture", "--pod", "--transparent",
                          f"{ROUTER_IP}:{TRANSPARENT_PORT}", "--allow", f"{p.host}:{p.port}",
                          timeout=60)
            assert out.returncode == 0, out.stderr
            for n in (ns, pod):
                n.upstream = tls_up  # type: ignore[attr-defined]
                n.plain = plain_up  # type: ignore[attr-defined]
            ns.pod = pod  # type: ignore[attr-defined]
            yield ns, p
        finally:
            stop_proxy(p)
            capture.remove(ns.router_if)
            tls_up.stop()
            plain_up.stop()


def ca_env(p: Proxy) -> dict[str, str]:
    """The usual places a client finds its trust roots (the launcher sets the same)."""
    return clean_env(SSL_CERT_FILE=str(p.ca), NODE_EXTRA_CA_CERTS=str(p.ca),
                     CURL_CA_BUNDLE=str(p.ca), REQUESTS_CA_BUNDLE=str(p.ca))


def counts(ns: SandboxNetns) -> dict[str, int]:
    found = capture.counters(ns.router_if)
    assert found is not None
    return {k: v["packets"] for k, v in found.items()}


def injected(ns: SandboxNetns, before: int) -> None:
    new = ns.upstream.seen[before:]  # type: ignore[attr-defined]
    assert new, "the upstream saw nothing"
    assert all(s.headers.get("x-api-key") == ANTHROPIC_KEY for s in new)


def test_curl_allowed_gets_the_key_denied_gets_a_readable_refusal(world):
    ns, p = world
    before = len(ns.upstream.seen)
    r = ns.run("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", "-X", "POST",
               "-d", "{}", f"https://{API}/v1/messages", env=ca_env(p))
    body, _, code = r.stdout.rpartition("\n")
    assert code == "200", r.stdout + r.stderr
    assert ANTHROPIC_KEY not in body
    injected(ns, before)
    ev = p.wait_audit(lambda e: e.get("event") == "request" and e.get("host") == API)
    assert ev["identity"] == "coding-agent" and ev["sandbox"] == "tp-sandbox-1"
    assert ev["identity_source"] == "cidr"
    r = ns.run("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}",
               f"https://{DENIED}/anything", env=ca_env(p))
    body, _, code = r.stdout.rpartition("\n")
    assert code == "403", r.stdout + r.stderr
    assert "no_rule" in body and DENIED in body and "coding-agent" in body
    p.wait_audit(lambda e: e.get("event") == "connect" and e.get("host") == DENIED)


def test_python_urllib_with_proxies_disabled(world):
    ns, p = world
    before = len(ns.upstream.seen)
    r = ns.run("python3", "-c", PYTHON_CLIENT, f"https://{API}/v1/messages", env=ca_env(p))
    status, body = split(r.stdout)
    assert status == 200, r.stdout + r.stderr
    assert ANTHROPIC_KEY not in body
    injected(ns, before)
    r = ns.run("python3", "-c", PYTHON_CLIENT, f"https://{DENIED}/x", env=ca_env(p))
    status, body = split(r.stdout)
    assert status == 403 and "no_rule" in body, r.stdout + r.stderr


def test_node_builtin_fetch(world):
    ns, p = world
    before = len(ns.upstream.seen)
    r = ns.run("node", "--input-type=module", "-e", NODE_CLIENT, f"https://{API}/v1/messages",
               env=ca_env(p))
    status, body = split(r.stdout)
    assert status == 200, r.stdout + r.stderr
    injected(ns, before)
    r = ns.run("node", "--input-type=module", "-e", NODE_CLIENT, f"https://{DENIED}/x",
               env=ca_env(p))
    status, body = split(r.stdout)
    assert status == 403 and "no_rule" in body, r.stdout + r.stderr


def test_go_default_transport(world, tmp_path_factory):
    ns, p = world
    exe = build_go_client(tmp_path_factory.mktemp("go"))
    before = len(ns.upstream.seen)
    r = ns.run(str(exe), f"https://{API}/v1/messages", env=ca_env(p))
    status, body = split(r.stdout)
    assert status == 200, r.stdout + r.stderr
    injected(ns, before)
    r = ns.run(str(exe), f"https://{DENIED}/x", env=ca_env(p))
    status, body = split(r.stdout)
    assert status == 403 and "no_rule" in body, r.stdout + r.stderr


def get(host: str) -> str:
    return f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"


def s_client(ns: SandboxNetns, p: Proxy, connect: str, *args: str, request: str) -> str:
    r = subprocess.run(["ip", "netns", "exec", ns.name, "openssl", "s_client", "-quiet",
                        "-verify_return_error", "-CAfile", str(p.ca), "-connect", connect,
                        *args], input=request, capture_output=True, text=True, timeout=20,
                       env=clean_env())
    return r.stdout + r.stderr


def test_openssl_s_client(world):
    ns, p = world
    before = len(ns.upstream.seen)
    out = s_client(ns, p, f"{API}:443", "-servername", API, request=get(API))
    assert "HTTP/1.1 200" in out, out
    injected(ns, before)


def test_sni_naming_another_address_is_refused_readably(world):
    # SNI names the allowed host, the connection goes to another address: were only the SNI
    # judged, a client could reach any address by lying in it.
    ns, p = world
    before = len(ns.upstream.seen)
    out = s_client(ns, p, f"{ELSEWHERE}:443", "-servername", API, request=get(API))
    assert "HTTP/1.1 400" in out and "does not resolve to" in out, out
    assert len(ns.upstream.seen) == before


def test_host_header_must_agree_with_sni(world):
    ns, p = world
    before = len(ns.upstream.seen)
    out = s_client(ns, p, f"{API}:443", "-servername", API, request=get(PASS))
    assert "HTTP/1.1 400" in out, out
    assert len(ns.upstream.seen) == before


def test_no_sni_is_refused_readably(world):
    ns, p = world
    out = s_client(ns, p, f"{UPSTREAM}:443", "-noservername", request=get(API))
    assert "HTTP/1.1 400" in out and "no SNI" in out, out


def test_plain_http_judged_by_host_header(world):
    ns, _ = world
    r = ns.run("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}",
               f"http://{PLAIN}/page")
    assert r.stdout.endswith("\n200"), r.stdout + r.stderr
    assert any(s.host == PLAIN for s in ns.plain.seen)
    # the Host header names an allowed host, the connection goes elsewhere: refused
    r = ns.run("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", "-H",
               f"Host: {PLAIN}", f"http://{ELSEWHERE}/page")
    assert r.stdout.endswith("\n400") and "does not resolve to" in r.stdout, r.stdout
    r = ns.run("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}",
               f"http://{DENIED}/page")
    assert r.stdout.endswith("\n403") and "no_rule" in r.stdout, r.stdout


def test_passthrough_stays_passthrough(world, tp_pki):
    # A passthrough rule: the upstream's own certificate reaches the client (only the upstream
    # CA is trusted here, so an intercepted connection would fail verification).
    ns, _ = world
    r = ns.run("curl", "-sS", "--max-time", "10", "--cacert", str(tp_pki.ca_cert), "-w",
               "\n%{http_code}", f"https://{PASS}/docs/x")
    assert r.stdout.endswith("\n200"), r.stdout + r.stderr


def test_unknown_source_refused(world):
    ns, p = world
    before = len(ns.upstream.seen)
    r = ns.run("curl", "-sS", "--max-time", "10", "--interface", STRANGER_IP, "-w",
               "\n%{http_code}", "-X", "POST", "-d", "{}", f"https://{API}/v1/messages",
               env=ca_env(p))
    assert r.stdout.endswith("\n407") and f"no sandbox is known at address {STRANGER_IP}" \
        in r.stdout, r.stdout + r.stderr
    assert len(ns.upstream.seen) == before


def test_other_ports_and_udp_go_nowhere_and_are_counted(world):
    ns, _ = world
    tcp = socket.socket()
    tcp.bind((UPSTREAM, RAW_PORT))
    tcp.listen(8)
    tcp.settimeout(0.1)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((UPSTREAM, UDP_PORT))
    udp.settimeout(0.1)
    got: list[bytes] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for s in (tcp, udp):
                try:
                    got.append(repr(s.accept()).encode() if s is tcp else s.recv(2048))
                except OSError:
                    pass

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        before = counts(ns)
        probe = (
            "import socket\n"
            f"s = socket.socket(); s.settimeout(2)\n"
            f"try:\n    s.connect(('{UPSTREAM}', {RAW_PORT})); print('tcp connected')\n"
            "except OSError as e:\n    print('tcp', type(e).__name__)\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"u.sendto(b'data', ('{UPSTREAM}', {UDP_PORT}))\n"
            f"u.sendto(b'quic', ('{UPSTREAM}', 443))\n"
        )
        r = ns.run("python3", "-c", probe)
        assert "tcp connected" not in r.stdout, r.stdout
        dig = ns.run("dig", "+tries=1", "+time=1", "@8.8.8.8", "example.com")
        assert "ANSWER SECTION" not in dig.stdout
        after = counts(ns)
    finally:
        stop.set()
        t.join()
        tcp.close()
        udp.close()
    assert got == []
    assert after["dropped_tcp"] > before["dropped_tcp"]
    assert after["dropped_udp"] > before["dropped_udp"]
    assert after["dropped_quic"] > before["dropped_quic"]
    assert after["dropped_dns"] > before["dropped_dns"]
    assert after["captured"] > 0


def scraped(ns: SandboxNetns) -> dict[str, int]:
    """sandgate_capture_packets_total of this sandbox network, as /metrics shows it."""
    with urllib.request.urlopen(f"http://{ADMIN}:{ADMIN_PORT}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "sandgate_capture_packets_total" \
                    and s.labels["network"] == ns.router_if:
                out[s.labels["counter"]] = int(s.value)
    return out


def test_dropped_udp_is_counted_in_metrics(world):
    ns, _ = world
    before = scraped(ns)
    assert set(before) == set(capture.COUNTERS), before
    r = ns.run("python3", "-c", "import socket; socket.socket(socket.AF_INET, "
               f"socket.SOCK_DGRAM).sendto(b'x', ('{UPSTREAM}', {UDP_PORT + 1}))")
    assert r.returncode == 0, r.stderr
    want = before["dropped_udp"] + 1
    deadline = time.monotonic() + 10  # a reading is reused for a second
    while (after := scraped(ns))["dropped_udp"] < want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after["dropped_udp"] >= want, (before, after)
    assert counts(ns)["dropped_udp"] >= after["dropped_udp"]  # what --status reads


def test_status_prints_the_counters(world):
    ns, _ = world
    r = subprocess.run([*SANDGATE, "capture", "--interface", ns.router_if,
                        "--status"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    names = [line.split("\t")[0] for line in r.stdout.splitlines()]
    assert names == list(capture.COUNTERS)


def test_absolute_form_target_cannot_name_another_host(world):
    # judged = forwarded: the request line's authority may not differ from the Host header
    ns, _ = world
    before = len(ns.plain.seen)
    r = ns.run("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", "--request-target",
               f"http://{DENIED}/page", f"http://{PLAIN}/page")
    assert r.stdout.endswith("\n400"), r.stdout + r.stderr
    assert len(ns.plain.seen) == before


def test_http2_inside_captured_tls(world):
    ns, p = world
    before = len(ns.upstream.seen)
    r = ns.run("curl", "-sS", "--http2", "--max-time", "10", "-w", "\n%{http_version} %{http_code}",
               "-X", "POST", "-d", "{}", f"https://{API}/v1/messages", f"https://{API}/v1/models",
               env=ca_env(p))
    assert r.stdout.count("\n2 200") == 2, r.stdout + r.stderr
    injected(ns, before)
    assert len(ns.upstream.seen) == before + 2


def test_pod_placement_captures_inside_the_sandbox_namespace(world):
    ns, p = world
    pod = ns.pod
    before = len(pod.upstream.seen)
    r = pod.run("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", "-X", "POST",
                "-d", "{}", f"https://{API}/v1/messages", env=ca_env(p))
    assert r.stdout.endswith("\n200"), r.stdout + r.stderr
    injected(pod, before)
    ev = p.wait_audit(lambda e: e.get("event") == "request" and e.get("sandbox") == "tp-pod-1")
    assert ev["identity"] == "coding-agent"
    r = pod.run("curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}",
                f"https://{DENIED}/x", env=ca_env(p))
    assert r.stdout.endswith("\n403") and "no_rule" in r.stdout, r.stdout + r.stderr
    # what is not captured goes nowhere, counted in the pod's own table
    r = pod.run("python3", "-c", "import socket; s = socket.socket(); s.settimeout(2)\n"
                f"try:\n    s.connect(('{UPSTREAM}', {RAW_PORT})); print('connected')\n"
                "except OSError:\n    print('dropped')")
    assert r.stdout.strip() == "dropped", r.stdout + r.stderr
    st = pod.run(*SANDGATE, "capture", "--pod", "--status")
    counted = dict(line.split("\t")[:2] for line in st.stdout.splitlines())
    assert counted["captured"] != "0 packets" and counted["dropped_tcp"] != "0 packets", st.stdout
