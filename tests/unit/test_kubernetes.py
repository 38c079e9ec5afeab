"""deploy/kubernetes: every manifest is valid Kubernetes (offline schemas, strict), the Deployment
runs `sandgate run` with flags the CLI accepts, and the NetworkPolicies keep the two promises the
deployment rests on: sandbox pods reach nothing but Sandgate's proxy port (and cluster DNS), and
only Sandgate reaches Vault. The invariant checks are themselves shown to catch a broken policy.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sandgate.cli import build_parser
from sandgate.policy.loader import load_policy_dir

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy/kubernetes"
# the oldest supported minor at the time of writing and the newest the validator knows
VERSIONS = ["1.31.0", kubernetes_validate.latest_version()]

Doc = dict[str, Any]
Labels = dict[str, str]

SANDBOX = ("sandboxes", {"sandgate.dev/sandbox": "true"})
SANDGATE = ("sandgate", {"app.kubernetes.io/name": "sandgate"})
VAULT = ("vault", {"app.kubernetes.io/name": "vault"})
REDIS = ("sandgate", {"app.kubernetes.io/name": "sandgate-redis"})
KUBE_DNS = ("kube-system", {"k8s-app": "kube-dns"})
OUTSIDE = ("<internet>", {})  # a public address: matched only by ipBlock peers


def _docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomized() -> list[Path]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [K8S / name for name in kust["resources"]]


def _all() -> list[Doc]:
    return [d for p in _kustomized() for d in _docs(p)]


def _one(kind: str, name: str) -> Doc:
    found = [d for d in _all() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _manifest_files() -> Iterator[Path]:
    yield from sorted(K8S.rglob("*.yaml"))


# --- schema ------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", list(_manifest_files()), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_is_valid_kubernetes(path: Path, version: str) -> None:
    if path.name == "kustomization.yaml":
        return
    for doc in _docs(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_what_kubernetes_would() -> None:
    deployment = copy.deepcopy(_one("Deployment", "sandgate"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(_one("Deployment", "sandgate"))
    deployment["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def test_kustomization_names_every_manifest_and_nothing_missing() -> None:
    listed = {p.name for p in _kustomized()}
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert all(p.exists() for p in _kustomized())


def test_every_object_is_namespaced_where_kubernetes_expects_it() -> None:
    for doc in _all():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace"), f"{doc['kind']}/{doc['metadata']['name']}"


# --- the Deployment ---------------------------------------------------------------------------

def _pod_spec() -> Doc:
    spec: Doc = _one("Deployment", "sandgate")["spec"]["template"]["spec"]
    return spec


def _container() -> Doc:
    (c,) = _pod_spec()["containers"]
    return c


def test_deployment_is_replicated_hardened_and_bounded() -> None:
    d = _one("Deployment", "sandgate")
    assert d["spec"]["replicas"] >= 2
    pod = _pod_spec()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"


def _run_args() -> list[str]:
    c = _container()
    args = list(c["args"])
    assert args[0] == "run"
    # $(POD_NAME) is expanded by the kubelet from the env the container declares
    declared = {e["name"] for e in c["env"]}
    return [a.replace("$(POD_NAME)", "sandgate-abc") if "POD_NAME" in declared else a
            for a in args]


def test_deployment_args_are_accepted_by_sandgate_run() -> None:
    args = build_parser().parse_args(_run_args())
    assert str(args.policies) == "/etc/sandgate/policies"
    assert args.admin == ("0.0.0.0", 9090)
    assert args.instance == "sandgate-abc"
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    assert mounts[str(args.policies)] == "policies"
    assert mounts[str(args.confdir)] == "confdir"
    assert str(args.admin_token_file).startswith(next(p for p, n in mounts.items()
                                                      if n == "admin-token"))


def test_probes_hit_paths_the_admin_api_serves_without_a_token() -> None:
    c = _container()
    args = build_parser().parse_args(_run_args())
    open_paths = {"/healthz", *args.admin_open}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in open_paths, probe
        assert ports[get["port"]] == args.admin[1], probe
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    annotations = _one("Deployment", "sandgate")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in open_paths
    assert int(annotations["prometheus.io/port"]) == args.admin[1]


def test_services_select_the_pods_and_split_proxy_from_admin() -> None:
    labels = _one("Deployment", "sandgate")["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    proxy, admin = _one("Service", "sandgate"), _one("Service", "sandgate-admin")
    for svc in (proxy, admin):
        assert svc["spec"]["selector"].items() <= labels.items()
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports
    assert [p["targetPort"] for p in proxy["spec"]["ports"]] == ["proxy"]
    assert [p["targetPort"] for p in admin["spec"]["ports"]] == ["admin"]
    # the fleet shares one state (redis.yaml): no Service for calling every replica
    assert not [d for d in _all() if d["kind"] == "Service"
                and d["metadata"]["name"] == "sandgate-admin-replicas"]
    pdb = _one("PodDisruptionBudget", "sandgate")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_secrets_in_git_hold_no_values() -> None:
    for path in _manifest_files():
        for doc in _docs(path):
            if doc["kind"] == "Secret":
                assert set(doc.get("stringData", {}).values()) <= {""}, path
                assert not doc.get("data"), path


def test_policy_configmap_is_the_repository_policy_and_loads() -> None:
    res = subprocess.run([sys.executable, str(REPO / "scripts/render-k8s-policies.py"),
                          "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cm = _one("ConfigMap", "sandgate-policies")
    assert set(cm["data"]) == {p.name for p in (REPO / "policies").glob("*.yaml")}


def test_policy_configmap_content_loads(tmp_path: Path) -> None:
    for name, text in _one("ConfigMap", "sandgate-policies")["data"].items():
        (tmp_path / name).write_text(text)
    policy = load_policy_dir(tmp_path)
    assert policy.identities


# --- NetworkPolicy invariants -----------------------------------------------------------------

Peer = tuple[str, Labels]


def _matches(selector: Doc | None, labels: Labels) -> bool:
    if selector is None:
        return False
    unsupported = set(selector) - {"matchLabels"}
    assert not unsupported, f"the invariant checker does not model {unsupported}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: Doc, own_ns: str, target: Peer) -> bool:
    ns, labels = target
    if "ipBlock" in peer:
        return ns == OUTSIDE[0]
    if ns == OUTSIDE[0]:
        return False
    if "namespaceSelector" in peer:
        ns_ok = _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": ns})
    else:
        ns_ok = ns == own_ns
    pod_ok = _matches(peer["podSelector"], labels) if "podSelector" in peer else True
    return ns_ok and pod_ok


def _policies(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] == "NetworkPolicy"]


def _allowed(docs: list[Doc], src: Peer, dst: Peer, port: int, proto: str = "TCP") -> bool:
    """Kubernetes semantics: a direction is open unless a policy selecting the pod isolates it;
    then only the union of that direction's rules admits traffic. Both ends must admit it."""

    def side(pod: Peer, direction: str, other: Peer) -> bool:
        ns, labels = pod
        if ns == OUTSIDE[0]:
            return True
        selecting = [p for p in _policies(docs) if p["metadata"]["namespace"] == ns
                     and _matches(p["spec"]["podSelector"], labels)
                     and direction in p["spec"].get("policyTypes", ["Ingress"])]
        if not selecting:
            return True
        key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
        for pol in selecting:
            for rule in pol["spec"].get(key, []):
                peers = rule.get(peers_key)
                if peers is not None and not any(_peer_matches(pr, ns, other) for pr in peers):
                    continue
                ports = rule.get("ports")
                if ports is None or any(p.get("port") == port and p.get("protocol", "TCP")
                                        == proto for p in ports):
                    return True
        return False

    return side(src, "Egress", dst) and side(dst, "Ingress", src)


OTHER_POD = ("default", {"app": "something"})
PORTS = [(53, "UDP"), (53, "TCP"), (80, "TCP"), (443, "TCP"), (8080, "TCP"), (8200, "TCP"),
         (9090, "TCP"), (22, "TCP")]


def _sandbox_reach(docs: list[Doc]) -> set[tuple[str, int, str]]:
    targets = {"sandgate": SANDGATE, "vault": VAULT, "dns": KUBE_DNS, "outside": OUTSIDE,
               "other": OTHER_POD, "another-sandbox": SANDBOX}
    return {(name, port, proto) for name, peer in targets.items() for port, proto in PORTS
            if _allowed(docs, SANDBOX, peer, port, proto)}


def _vault_reachers(docs: list[Doc]) -> set[str]:
    sources = {"sandgate": SANDGATE, "sandbox": SANDBOX, "other": OTHER_POD,
               "outside": OUTSIDE, "dns": KUBE_DNS}
    return {name for name, peer in sources.items() if _allowed(docs, peer, VAULT, 8200)}


def test_sandbox_pods_reach_only_sandgate_and_dns() -> None:
    assert _sandbox_reach(_all()) == {("sandgate", 8080, "TCP"), ("dns", 53, "UDP"),
                                      ("dns", 53, "TCP")}


def test_only_sandgate_reaches_vault() -> None:
    assert _vault_reachers(_all()) == {"sandgate"}


def test_only_sandgate_reaches_the_fleet_state() -> None:
    sources = {"sandgate": SANDGATE, "sandbox": SANDBOX, "other": OTHER_POD,
               "outside": OUTSIDE, "vault": VAULT}
    assert {n for n, p in sources.items() if _allowed(_all(), p, REDIS, 6379)} == {"sandgate"}
    assert not _allowed(_all(), REDIS, OUTSIDE, 443)


def test_sandgate_runs_with_the_shared_state_and_its_password_from_a_file() -> None:
    args = build_parser().parse_args(_run_args())
    assert args.state.startswith("redis://sandgate-redis.sandgate.svc:")
    assert "@" not in args.state  # the password is not on the command line
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    assert str(args.state_password_file).startswith(next(p for p, n in mounts.items()
                                                         if n == "redis-password"))
    redis = _one("StatefulSet", "sandgate-redis")["spec"]["template"]
    assert redis["metadata"]["labels"].items() >= REDIS[1].items()
    (c,) = redis["spec"]["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--requirepass" in c["args"]


def test_sandgate_admin_port_is_not_open_to_sandboxes() -> None:
    assert not _allowed(_all(), SANDBOX, SANDGATE, 9090)
    assert _allowed(_all(), ("monitoring", {"sandgate.dev/admin-client": "true"}), SANDGATE, 9090)


def test_sandgate_dials_the_outside_but_not_cluster_pods() -> None:
    docs = _all()
    assert _allowed(docs, SANDGATE, OUTSIDE, 443)
    assert not _allowed(docs, SANDGATE, OTHER_POD, 443)
    sandgate_policy = _one("NetworkPolicy", "sandgate")
    blocks = [pr["ipBlock"] for rule in sandgate_policy["spec"]["egress"] for pr in rule["to"]
              if "ipBlock" in pr]
    for block in blocks:
        if block["cidr"] == "0.0.0.0/0":
            assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                    "169.254.0.0/16"} <= set(block["except"])


@pytest.mark.parametrize("breakage", ["sandbox egress to anywhere", "no default deny and no "
                                      "sandbox policy", "vault open to all", "dns any port"])
def test_the_invariant_checks_catch_a_broken_policy(breakage: str) -> None:
    docs = copy.deepcopy(_all())
    pols = {d["metadata"]["name"]: d for d in _policies(docs)}
    if breakage == "sandbox egress to anywhere":
        pols["sandbox-egress-only-via-sandgate"]["spec"]["egress"].append(
            {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})
    elif breakage == "no default deny and no sandbox policy":
        docs.remove(pols["default-deny"])
        docs.remove(pols["sandbox-egress-only-via-sandgate"])
    elif breakage == "vault open to all":
        pols["vault-only-from-sandgate"]["spec"]["ingress"][0]["from"].append(
            {"namespaceSelector": {}})
    else:
        del pols["sandbox-egress-only-via-sandgate"]["spec"]["egress"][1]["ports"]
    broken = (_sandbox_reach(docs) != {("sandgate", 8080, "TCP"), ("dns", 53, "UDP"),
                                       ("dns", 53, "TCP")}
              or _vault_reachers(docs) != {"sandgate"})
    assert broken
