"""Offline checks of deploy/ (kustomize): it parses, hangs together, and its configs are valid.

No cluster needed. The Envoy bootstrap goes through the real binary's `--mode validate`;
`kubectl kustomize` is used when kubectl is installed.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from xds_server.config import load_config, parse_config, parse_host_port
from xds_server.envoy_process import EnvoyError, validate_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}
TRIMTAB_DNS = "trimtab.trimtab.svc.cluster.local"


# -- loading -----------------------------------------------------------------------------


def _load_yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def manifest_files() -> list[Path]:
    """Files of Kubernetes objects: kustomization resources plus deploy/optional/."""
    listed = [DEPLOY / name for name in kustomization()["resources"]]
    return listed + sorted((DEPLOY / "optional").glob("*.yaml"))


def objects() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in _load_yaml_docs(path)]


def _generator_files(generator: dict[str, Any]) -> Iterator[tuple[str, Path]]:
    for entry in generator.get("files", []):
        key, _, path = entry.rpartition("=")
        yield key or Path(path).name, DEPLOY / path


def generated_configmaps() -> dict[str, dict[str, str]]:
    """configMapGenerator output: name -> {key: file text}."""
    out: dict[str, dict[str, str]] = {}
    for generator in kustomization().get("configMapGenerator", []):
        data = {key: path.read_text() for key, path in _generator_files(generator)}
        for literal in generator.get("literals", []):
            key, _, value = literal.partition("=")
            data[key] = value
        out[generator["name"]] = data
    return out


def configmaps() -> dict[str, dict[str, str]]:
    found = {o["metadata"]["name"]: dict(o.get("data", {}))
             for o in objects() if o["kind"] == "ConfigMap"}
    return {**found, **generated_configmaps()}


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads() -> list[dict[str, Any]]:
    return [o for o in objects() if o["kind"] in WORKLOADS]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def trimtab_config():
    return parse_config(yaml.safe_load(generated_configmaps()["trimtab-config"]["config.yaml"]))


def service_port(service: str, name: str) -> int:
    ports = find("Service", service)["spec"]["ports"]
    return next(p["port"] for p in ports if p["name"] == name)


def container_port(workload: str, name: str) -> int:
    ports = containers(find("Deployment", workload))[0]["ports"]
    return next(p["containerPort"] for p in ports if p["name"] == name)


# -- structure ---------------------------------------------------------------------------


def test_every_yaml_and_json_file_parses():
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yaml", ".yml", ".json"})
    assert len(files) >= 10
    for path in files:
        if path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict), path
        else:
            assert _load_yaml_docs(path), f"{path} is empty"


def test_every_object_has_api_version_kind_and_name():
    found = objects()
    assert len(found) >= 12
    for obj in found:
        assert isinstance(obj, dict), obj
        assert obj.get("apiVersion") and obj.get("kind"), obj
        assert obj.get("metadata", {}).get("name"), obj


def test_kustomization_resources_exist_and_cover_every_manifest():
    custom = kustomization()
    assert custom["namespace"] == "trimtab"
    for name in custom["resources"]:
        assert (DEPLOY / name).is_file(), f"kustomization resource {name} is missing"
    for generator in custom["configMapGenerator"]:
        for _key, path in _generator_files(generator):
            assert path.is_file(), f"configMapGenerator {generator['name']}: {path} missing"
    top_level = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert top_level == set(custom["resources"]), "every deploy/*.yaml must be a resource"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_renders_everything_into_the_namespace():
    result = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    listed = {(o["kind"], o["metadata"]["name"])
              for path in manifest_files() if path.parent == DEPLOY for o in _load_yaml_docs(path)}
    assert names == listed | {("ConfigMap", name) for name in generated_configmaps()}
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "trimtab", doc["metadata"]


def _templates_selected_by(service: dict[str, Any]) -> list[dict[str, Any]]:
    selector = service["spec"]["selector"]
    return [w for w in workloads()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]


def _port_exists(workload: dict[str, Any], port: int | str) -> bool:
    ports = [p for c in containers(workload) for p in c.get("ports", [])]
    key = "name" if isinstance(port, str) else "containerPort"
    return any(p.get(key) == port for p in ports)


def test_service_selectors_and_target_ports_match_pod_templates():
    services = [o for o in objects() if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} >= {"trimtab", "envoy", "vllm-llama3-8b"}
    for service in services:
        selected = _templates_selected_by(service)
        assert selected, f"Service {service['metadata']['name']} selects no pod template"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(_port_exists(w, target) for w in selected), (
                f"Service {service['metadata']['name']} targetPort {target!r} is not a "
                f"container port of the pods it selects")


def _probes(container: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container.get(kind)
        if probe:
            yield kind, next(probe[k] for k in ("httpGet", "tcpSocket", "grpc") if k in probe)


def test_probe_ports_exist():
    checked = 0
    for workload in workloads():
        for container in containers(workload):
            for kind, action in _probes(container):
                assert _port_exists(workload, action["port"]), (
                    f"{workload['metadata']['name']}/{container['name']} {kind} uses port "
                    f"{action['port']!r}, which the container does not declare")
                checked += 1
    assert checked >= 8


def _configmap_mounts(workload: dict[str, Any]) -> dict[str, str]:
    """mountPath -> ConfigMap name for every ConfigMap volume a container mounts."""
    volumes = {v["name"]: v["configMap"]["name"]
               for v in workload["spec"]["template"]["spec"].get("volumes", [])
               if "configMap" in v}
    return {m["mountPath"]: volumes[m["name"]] for c in containers(workload)
            for m in c.get("volumeMounts", []) if m["name"] in volumes}


def test_every_configmap_volume_and_mounted_file_exists():
    known = configmaps()
    for workload in workloads():
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in known, volume
        for mount, name in _configmap_mounts(workload).items():
            for container in containers(workload):
                for arg in container.get("args", []):
                    if arg.startswith(mount + "/"):
                        key = arg[len(mount) + 1:]
                        assert key in known[name], f"{arg}: ConfigMap {name} has no key {key}"


# -- trimtab -----------------------------------------------------------------------------


def test_trimtab_config_in_the_configmap_is_valid_and_matches_the_ports():
    config = trimtab_config()
    assert config.xds.host_port.host == config.admin.host_port.host == "0.0.0.0"
    assert config.xds.host_port.port == container_port("trimtab", "xds") == 18000
    assert config.admin.host_port.port == container_port("trimtab", "admin") == 19100
    assert config.listener.host_port.port == container_port("envoy", "http")
    assert [p.name for p in config.pools] == ["llama3-8b"]


def test_trimtab_config_file_loads_with_trimtabs_loader():
    config = load_config(DEPLOY / "config" / "trimtab.yaml")  # what `trimtab serve` reads
    assert config == trimtab_config()  # the ConfigMap carries exactly that file


def _scaled_object() -> dict[str, Any]:
    return find("ScaledObject", "vllm-llama3-8b")


def _service_port_by_number(service: str, port: int) -> dict[str, Any]:
    (entry,) = [p for p in find("Service", service)["spec"]["ports"] if p["port"] == port]
    return entry


def test_keda_scaler_port_agrees_everywhere():
    config = trimtab_config()
    assert config.keda.address is not None, "no keda.address: the scaler would never start"
    keda = parse_host_port(config.keda.address)
    assert keda.host == "0.0.0.0"
    (trigger,) = _scaled_object()["spec"]["triggers"]
    target = parse_host_port(trigger["metadata"]["scalerAddress"])
    assert target.host == TRIMTAB_DNS
    service_entry = _service_port_by_number("trimtab", target.port)  # what KEDA dials
    assert service_entry["targetPort"] == "scaler"
    assert keda.port == container_port("trimtab", "scaler") == 19200


def test_pool_scaling_bounds_match_the_scaledobject():
    scaled = _scaled_object()
    (trigger,) = scaled["spec"]["triggers"]
    scaling = trimtab_config().pool(trigger["metadata"]["pool"]).scaling
    assert scaling is not None, "the pool KEDA scales has no `scaling` policy"
    assert scaling.max_replicas == scaled["spec"]["maxReplicaCount"]
    assert scaling.min_replicas == scaled["spec"]["minReplicaCount"]


def test_pool_discovers_the_scaled_vllm_service():
    (trigger,) = _scaled_object()["spec"]["triggers"]
    pool = trimtab_config().pool(trigger["metadata"]["pool"])
    assert pool.discovery is not None and not pool.endpoints  # no static pod IPs
    k8s = pool.discovery.kubernetes
    assert k8s.namespace == kustomization()["namespace"] and k8s.api_server is None
    service = find("Service", k8s.service)
    assert k8s.port_name in {p["name"] for p in service["spec"]["ports"]}
    target = _scaled_object()["spec"]["scaleTargetRef"]
    assert target["name"] in {w["metadata"]["name"] for w in _templates_selected_by(service)}
    # discovered endpoints carry no dcgm_url: the weights must come from the model server
    assert trimtab_config().weights.policy == "composite"


def test_trimtab_deployment_contract():
    deployment = find("Deployment", "trimtab")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"][:3] == ["serve", "--config", "/etc/trimtab/config.yaml"]
    assert _configmap_mounts(deployment) == {"/etc/trimtab": "trimtab-config"}
    probes = {kind: (action["path"], action["port"]) for kind, action in _probes(container)}
    assert probes["livenessProbe"] == ("/healthz", "admin")
    assert probes["readinessProbe"] == ("/readyz", "admin")
    for key in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][key].keys()
    assert spec["serviceAccountName"] == "trimtab"
    assert {p["name"]: p["port"] for p in find("Service", "trimtab")["spec"]["ports"]} == {
        "grpc-xds": 18000, "http-admin": 19100, "grpc-scaler": 19200}


def test_rbac_only_reads_endpointslices():
    rules = find("Role", "trimtab-endpointslice-reader")["rules"]
    assert rules == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                      "verbs": ["get", "list", "watch"]}]
    binding = find("RoleBinding", "trimtab-endpointslice-reader")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "trimtab-endpointslice-reader"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trimtab",
                                    "namespace": "trimtab"}]
    find("ServiceAccount", "trimtab")
    assert not [o for o in objects() if o["kind"] in {"ClusterRole", "ClusterRoleBinding"}]


# -- Envoy -------------------------------------------------------------------------------


def envoy_bootstrap() -> dict[str, Any]:
    return yaml.safe_load(generated_configmaps()["envoy-bootstrap"]["envoy.yaml"])


def test_envoy_bootstrap_points_ads_at_the_trimtab_service():
    bootstrap = envoy_bootstrap()
    (cluster,) = bootstrap["static_resources"]["clusters"]
    assert cluster["name"] == "xds_cluster" and cluster["type"] == "STRICT_DNS"
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    socket = endpoint["endpoint"]["address"]["socket_address"]
    assert (socket["address"], socket["port_value"]) == (
        TRIMTAB_DNS, service_port("trimtab", "grpc-xds"))
    grpc_service = bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]
    assert grpc_service["envoy_grpc"]["cluster_name"] == "xds_cluster"
    admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
    assert admin_port == container_port("envoy", "envoy-admin")


def _envoy_validate(config: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    try:
        return validate_config(config)
    except EnvoyError as exc:
        pytest.skip(f"no Envoy binary: {exc}")


def test_envoy_bootstrap_passes_envoy_validate():
    result = _envoy_validate(envoy_bootstrap())
    assert result.returncode == 0, result.stdout + result.stderr
    broken = copy.deepcopy(envoy_bootstrap())  # the check can fail: a typo is caught
    broken["static_resources"]["clusters"][0]["type"] = "STRICT_DNZ"
    assert _envoy_validate(broken).returncode != 0


# -- KEDA, vLLM, Prometheus, Grafana -----------------------------------------------------


def test_scaledobject_targets_the_vllm_deployment_through_the_scaler_port():
    scaled = find("ScaledObject", "vllm-llama3-8b")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    target = scaled["spec"]["scaleTargetRef"]
    find(target.get("kind", "Deployment"), target["name"])
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "external"
    assert trigger["metadata"]["pool"] in {p.name for p in trimtab_config().pools}
    address = parse_host_port(trigger["metadata"]["scalerAddress"])
    assert (address.host, address.port) == (TRIMTAB_DNS, service_port("trimtab", "grpc-scaler"))
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_vllm_example_serves_the_pools_model_on_a_gpu():
    (container,) = find("Deployment", "vllm-llama3-8b")["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("vllm/vllm-openai:")
    args = container["args"]
    assert args[args.index("--model") + 1] == trimtab_config().pool("llama3-8b").model
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_prometheus_scrapes_trimtab_vllm_and_a_fast_dcgm_exporter():
    text = generated_configmaps()["prometheus-config"]["prometheus.yml"]
    assert text == (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    jobs = {job["job_name"]: job for job in yaml.safe_load(text)["scrape_configs"]}
    assert {"trimtab", "vllm", "dcgm-exporter"} <= jobs.keys()
    (target,) = jobs["trimtab"]["static_configs"][0]["targets"]
    assert target == f"{TRIMTAB_DNS}:{service_port('trimtab', 'http-admin')}"
    assert jobs["dcgm-exporter"]["scrape_interval"] == "2s"
    assert "DCGM_EXPORTER_INTERVAL=1000" in text
    daemonset = yaml.safe_load((DEPLOY / "optional" / "dcgm-exporter.yaml").read_text())
    env = {e["name"]: e["value"] for e in containers(daemonset)[0]["env"]}
    assert env["DCGM_EXPORTER_INTERVAL"] == "1000"


_METRIC = re.compile(r"\b(?:trimtab_\w+|DCGM_FI_\w+|vllm:\w+|envoy_\w+)")
_SUFFIXES = ("_bucket", "_sum", "_count")


def readme_metrics() -> set[str]:
    return set(_METRIC.findall((ROOT / "README.md").read_text()))


def _queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if node.get("type") == "datasource":  # a data-source picker, not a query
            return
        for key, value in node.items():
            if key in {"expr", "definition"} or (key == "query" and isinstance(value, str)):
                yield value
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def _base_name(metric: str, known: set[str]) -> str:
    for suffix in _SUFFIXES:
        if metric.endswith(suffix) and metric[: -len(suffix)] in known:
            return metric[: -len(suffix)]
    return metric


def test_grafana_dashboard_only_uses_metrics_documented_in_readme():
    known = readme_metrics()
    assert "trimtab_endpoint_weight" in known and "trimtab_xds_nacks_total" in known
    dashboard = json.loads((DEPLOY / "grafana" / "trimtab-dashboard.json").read_text())
    used: set[str] = set()
    for query in _queries(dashboard):
        metrics = {_base_name(m, known) for m in _METRIC.findall(query)}
        assert metrics, f"query uses no known metric: {query}"
        assert metrics <= known, f"not in README: {sorted(metrics - known)} in {query}"
        used |= metrics
    assert {"trimtab_endpoint_weight", "trimtab_xds_nacks_total", "trimtab_xds_pushes_total",
            "trimtab_tick_duration_seconds", "trimtab_stale_endpoints",
            "trimtab_pool_fail_static"} <= used
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
