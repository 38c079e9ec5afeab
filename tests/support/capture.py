"""Transparent capture without Docker: a sandbox network namespace behind a router namespace.

The router is the test's own namespace (Sandgate, the upstreams and the nftables table live
there); the sandbox is a namespace of its own, linked by a veth pair, its default route via the
router, its /etc/hosts its own (`ip netns exec` mounts /etc/netns/NAME/hosts over it). Clients
run in it with no proxy setting at all. Also: the clients that ignore proxy variables (Node's
fetch, a Go program with the default transport), built and run here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROUTER_IP, SANDBOX_IP, STRANGER_IP = "10.64.0.1", "10.64.0.2", "10.64.0.3"

# what a sandbox's environment must not carry: the clients here have no proxy settings at all
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def sh(*cmd: str, check: bool = True, timeout: float = 60,
       env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout,
                          env=dict(env) if env is not None else None)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in PROXY_VARS}
    env.update(extra)
    return env


@dataclass
class SandboxNetns:
    name: str
    router_if: str  # the router's end of the veth: the capture table's --interface
    router_ip: str = ROUTER_IP
    ip: str = SANDBOX_IP

    def run(self, *cmd: str, timeout: float = 30, check: bool = False,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return sh("ip", "netns", "exec", self.name, *cmd, check=check, timeout=timeout,
                  env=env if env is not None else clean_env())


@contextmanager
def sandbox_netns(hosts: Mapping[str, str], net: int = 0) -> Iterator[SandboxNetns]:
    """A sandbox namespace at SANDBOX_IP (and STRANGER_IP, a source no identity names) whose
    only route is the router at ROUTER_IP; `hosts` name -> address is its /etc/hosts. `net`
    N > 0: another one, on 10.64.N.0/29 (same host numbers)."""
    router_ip, sandbox_ip, stranger_ip = (a.replace("10.64.0.", f"10.64.{net}.")
                                          for a in (ROUTER_IP, SANDBOX_IP, STRANGER_IP))
    name = f"sgtp-{uuid.uuid4().hex[:6]}"
    veth = f"tp{name[-6:]}"
    etc = Path("/etc/netns") / name
    sh("ip", "netns", "add", name)
    try:
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{ip} {host}\n" for host, ip in hosts.items()))
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}s")
        sh("ip", "link", "set", f"{veth}s", "netns", name)
        sh("ip", "addr", "add", f"{router_ip}/29", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        for ip in (sandbox_ip, stranger_ip):
            sh("ip", "-n", name, "addr", "add", f"{ip}/29", "dev", f"{veth}s")
        sh("ip", "-n", name, "link", "set", f"{veth}s", "up")
        sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "-n", name, "route", "add", "default", "via", router_ip)
        yield SandboxNetns(name, veth, router_ip, sandbox_ip)
    finally:
        sh("ip", "link", "del", veth, check=False)
        sh("ip", "netns", "del", name, check=False)
        shutil.rmtree(etc, ignore_errors=True)


@contextmanager
def local_addresses(addresses: Sequence[str]) -> Iterator[None]:
    """Addresses of this (the router's) namespace, on lo: where the test upstreams listen."""
    for a in addresses:
        sh("ip", "addr", "add", f"{a}/32", "dev", "lo")
    try:
        yield
    finally:
        for a in addresses:
            sh("ip", "addr", "del", f"{a}/32", "dev", "lo", check=False)


GO_CLIENT = """package main

import (
\t"fmt"
\t"io"
\t"net/http"
\t"os"
\t"strings"
)

// The default transport: it would read HTTPS_PROXY, and there is none. SSL_CERT_FILE names
// the CA it trusts.
func main() {
\tresp, err := http.Post(os.Args[1], "application/json", strings.NewReader("{}"))
\tif err != nil {
\t\tfmt.Println("error:", err)
\t\tos.Exit(1)
\t}
\tdefer resp.Body.Close()
\tbody, _ := io.ReadAll(resp.Body)
\tfmt.Println(resp.StatusCode)
\tfmt.Print(string(body))
}
"""

NODE_CLIENT = """
const r = await fetch(process.argv[1], {method: 'POST', body: '{}',
                                        headers: {'content-type': 'application/json'}});
console.log(r.status);
process.stdout.write(await r.text());
"""

PYTHON_CLIENT = """
import sys, urllib.request, urllib.error
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # proxies disabled
req = urllib.request.Request(sys.argv[1], data=b"{}", method="POST",
                             headers={"content-type": "application/json"})
try:
    with opener.open(req, timeout=10) as r:
        print(r.status); sys.stdout.write(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); sys.stdout.write(e.read().decode())
"""


def build_go_client(directory: Path) -> Path:
    """The Go client, standard library only, built offline into `directory`."""
    src = directory / "goclient"
    src.mkdir(parents=True, exist_ok=True)
    (src / "main.go").write_text(GO_CLIENT)
    (src / "go.mod").write_text("module goclient\n\ngo 1.19\n")
    exe = src / "goclient"
    env = clean_env(GOFLAGS="-mod=mod", GOPROXY="off", CGO_ENABLED="0")
    env.setdefault("GOCACHE", str(Path.home() / ".cache" / "go-build"))
    res = subprocess.run(["go", "build", "-o", str(exe), "."], cwd=src, env=env,
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"go build failed: {res.stderr[-2000:]}")
    return exe


def split(out: str) -> tuple[int, str]:
    """A client's `STATUS\\nBODY` output."""
    first, _, rest = out.partition("\n")
    try:
        return int(first.strip()), rest
    except ValueError:
        return 0, out
