"""Offline checks of deploy/ (kustomize): it parses, hangs together, and its configs are valid.

No cluster needed. The Envoy bootstraps go through the real binary's `--mode validate`;
`kubectl kustomize` is used when kubectl is installed. deploy/ is deploy/base/ (plaintext xDS
behind a NetworkPolicy, the admin token from a Secret); deploy/overlays/mtls adds mTLS.
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

from tests.support.wait import wait_until_async
from trimtab_dev.envoy_process import EnvoyError, validate_config
from xds_server.config.addresses import parse_host_port
from xds_server.config.load import load_config, parse_config
from xds_server.security.admin_auth import load_token

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
MTLS = DEPLOY / "overlays" / "mtls"
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}
TRIMTAB_DNS = "trimtab.trimtab.svc.cluster.local"


# -- loading -----------------------------------------------------------------------------


def _load_yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization(root: Path = BASE) -> dict[str, Any]:
    return yaml.safe_load((root / "kustomization.yaml").read_text())


def manifest_files() -> list[Path]:
    """Files of Kubernetes objects: the base's kustomization resources plus deploy/optional/."""
    listed = [BASE / name for name in kustomization()["resources"]]
    return listed + sorted((DEPLOY / "optional").glob("*.yaml"))


def objects() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in _load_yaml_docs(path)]


def _generator_files(generator: dict[str, Any], root: Path = BASE
                     ) -> Iterator[tuple[str, Path]]:
    for entry in generator.get("files", []):
        key, _, path = entry.rpartition("=")
        yield key or Path(path).name, root / path


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
        assert (BASE / name).is_file(), f"kustomization resource {name} is missing"
    for generator in custom["configMapGenerator"]:
        for _key, path in _generator_files(generator):
            assert path.is_file(), f"configMapGenerator {generator['name']}: {path} missing"
    top_level = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert top_level == set(custom["resources"]), "every deploy/base/*.yaml must be a resource"
    # `kubectl apply -k deploy/` is the base as it is; the overlay builds on the base too
    assert kustomization(DEPLOY)["resources"] == ["base"]
    assert {p.name for p in DEPLOY.glob("*.yaml")} == {"kustomization.yaml"}
    assert "../../base" in kustomization(MTLS)["resources"]


def test_kubectl_kustomize_renders_everything_into_the_namespace():
    rendered = render(DEPLOY)
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    listed = {(o["kind"], o["metadata"]["name"])
              for path in manifest_files() if path.parent == BASE for o in _load_yaml_docs(path)}
    assert names == listed | {("ConfigMap", name) for name in generated_configmaps()}
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "trimtab", doc["metadata"]


def render(root: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize root`, parsed; skips the test without kubectl."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed")
    result = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


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
    config = load_config(BASE / "config" / "trimtab.yaml")  # what `trimtab serve` reads
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


def test_rbac_only_reads_inferencepools_and_pods():
    """What InferencePool discovery lists and watches (xds_server/control/discovery/
    inference_pool.py), read-only, in trimtab's namespace."""
    from xds_server.control.discovery.inference_pool import GROUP, PLURAL

    rules = find("Role", "trimtab-inferencepool-reader")["rules"]
    assert rules == [{"apiGroups": [GROUP], "resources": [PLURAL],
                      "verbs": ["get", "list", "watch"]},
                     {"apiGroups": [""], "resources": ["pods"],
                      "verbs": ["get", "list", "watch"]}]
    binding = find("RoleBinding", "trimtab-inferencepool-reader")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "trimtab-inferencepool-reader"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trimtab",
                                    "namespace": "trimtab"}]


def _template_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_trimtab_runs_three_replicas_spread_over_nodes_under_a_disruption_budget():
    deployment = find("Deployment", "trimtab")
    assert deployment["spec"]["replicas"] == 3
    labels = _template_labels(deployment)
    spec = deployment["spec"]["template"]["spec"]
    spread = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    hostname = spread["kubernetes.io/hostname"]
    assert hostname["maxSkew"] == 1 and hostname["whenUnsatisfiable"] == "DoNotSchedule"
    for constraint in spread.values():
        assert constraint["labelSelector"]["matchLabels"].items() <= labels.items()
    pdb = find("PodDisruptionBudget", "trimtab")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1 < deployment["spec"]["replicas"]
    (container,) = spec["containers"]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert trimtab_config().coordination.kubernetes.identity is None  # so $POD_NAME it is


def test_replicas_elect_a_leader_and_keep_rollout_state_in_the_api_server():
    config = trimtab_config()
    k8s = config.coordination.kubernetes
    assert k8s is not None and k8s.namespace == kustomization()["namespace"]
    assert k8s.api_server is None  # in-cluster service account
    assert k8s.renew_seconds < k8s.renew_deadline < k8s.lease_seconds
    assert "drive" not in config.rollouts.model_fields_set  # deprecated, not set
    lease = find("Lease", k8s.lease_name)
    assert lease["apiVersion"] == "coordination.k8s.io/v1"
    state = find("ConfigMap", k8s.state_configmap)
    assert "data" not in state  # re-applying deploy/ never touches what trimtab wrote
    # Envoys spread over the replicas: connections age out (gRPC jitters the age ±10 %)
    limits = config.xds.limits
    assert limits.max_connection_age_seconds is not None
    assert 60 <= limits.max_connection_age_seconds <= 3600
    assert limits.max_connection_age_grace_seconds > 0
    # one Prometheus for every replica: same inputs, the model servers scraped once
    assert config.telemetry.source == "prometheus"
    assert config.telemetry.prometheus.url.startswith("http://prometheus.monitoring.svc")
    assert all(pool.source(config) == "prometheus" for pool in config.pools)


def test_rbac_for_coordination_is_get_and_update_of_the_two_named_objects():
    k8s = trimtab_config().coordination.kubernetes
    assert k8s is not None
    rules = find("Role", "trimtab-coordination")["rules"]
    assert rules == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": [k8s.lease_name], "verbs": ["get", "update"]},
        {"apiGroups": [""], "resources": ["configmaps"],
         "resourceNames": [k8s.state_configmap], "verbs": ["get", "update"]}]
    binding = find("RoleBinding", "trimtab-coordination")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "trimtab-coordination"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trimtab",
                                    "namespace": "trimtab"}]
    roles = {o["metadata"]["name"] for o in objects() if o["kind"] == "Role"}
    assert roles == {"trimtab-endpointslice-reader", "trimtab-inferencepool-reader",
                     "trimtab-coordination"}


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


def test_every_configmap_is_mounted_or_picked_up_by_its_label():
    """A ConfigMap nothing reads is a prerequisite in disguise (the Prometheus scrape config
    once was one: a Prometheus in `monitoring` cannot mount a ConfigMap of namespace trimtab)."""
    mounted = {name for workload in workloads()
               for name in _configmap_mounts(workload).values()}
    written = {"trimtab-rollouts"}  # trimtab's rollout state (trimtab-coordination.yaml)
    for name in configmaps():
        labels = next((o["metadata"].get("labels", {}) for o in objects()
                       if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name), {})
        for generator in kustomization().get("configMapGenerator", []):
            if generator["name"] == name:
                labels = generator.get("options", {}).get("labels", {})
        assert name in mounted | written or labels.get("grafana_dashboard") == "1", name
    assert "prometheus-config" not in configmaps()


def test_prometheus_scrapes_trimtab_vllm_and_a_fast_dcgm_exporter():
    text = (BASE / "prometheus" / "prometheus.yml").read_text()  # merged into your Prometheus
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


def documented_metrics() -> set[str]:
    return set(_METRIC.findall((ROOT / "docs" / "metrics.md").read_text()))


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


def test_grafana_dashboard_only_uses_metrics_documented_in_docs_metrics():
    known = documented_metrics()
    assert "trimtab_endpoint_weight" in known and "trimtab_xds_nacks_total" in known
    dashboard = json.loads((BASE / "grafana" / "trimtab-dashboard.json").read_text())
    used: set[str] = set()
    for query in _queries(dashboard):
        metrics = {_base_name(m, known) for m in _METRIC.findall(query)}
        assert metrics, f"query uses no known metric: {query}"
        assert metrics <= known, f"not in docs/metrics.md: {sorted(metrics - known)} in {query}"
        used |= metrics
    assert {"trimtab_endpoint_weight", "trimtab_xds_nacks_total", "trimtab_xds_pushes_total",
            "trimtab_tick_duration_seconds", "trimtab_stale_endpoints",
            "trimtab_pool_fail_static"} <= used
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]


# -- safe by default: admin token, NetworkPolicy (issue 12 §6) ------------------------------

TOKEN_SECRET = "trimtab-admin-token"


def _secret_volumes(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the `secret` volume source mounted there."""
    volumes = {v["name"]: v["secret"] for v in workload["spec"]["template"]["spec"]["volumes"]
               if "secret" in v}
    return {m["mountPath"]: volumes[m["name"]] for c in containers(workload)
            for m in c.get("volumeMounts", []) if m["name"] in volumes}


def _secret_file(workload: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """(the secret volume whose mount holds `path`, the Secret key that file is)."""
    parent, _, name = path.rpartition("/")
    source = _secret_volumes(workload).get(parent)
    assert source is not None, f"{path}: no Secret volume is mounted at {parent}"
    keys = {item["path"]: item["key"] for item in source.get("items", [])} or {name: name}
    assert name in keys, f"{path}: Secret {source['secretName']} mount has no file {name}"
    return source, keys[name]


def _fails_closed(source: dict[str, Any], workload: dict[str, Any]) -> None:
    assert source.get("optional") is not True  # a missing Secret keeps the pod from starting
    mode = source.get("defaultMode", 0o644)
    assert mode & 0o007 == 0, f"Secret {source['secretName']} files are world-readable"
    pod = workload["spec"]["template"]["spec"]["securityContext"]
    assert mode & 0o040 and pod.get("fsGroup") == pod["runAsUser"], \
        "the non-root container must be able to read its Secret (fsGroup + group-read)"


def test_admin_token_comes_from_a_secret_the_deployment_cannot_start_without():
    auth = trimtab_config().admin.auth
    assert auth.token_file is not None and auth.token_env is None
    source, key = _secret_file(find("Deployment", "trimtab"), auth.token_file)
    assert (source["secretName"], key) == (TOKEN_SECRET, "token")
    _fails_closed(source, find("Deployment", "trimtab"))
    # Not shipped: a token in the repository would be everyone's token.
    assert not [o for o in objects() if o["kind"] == "Secret"]
    assert "secretGenerator" not in kustomization()
    # The step that creates it is documented, with a random value.
    readme = (DEPLOY / "README.md").read_text()
    assert (f"kubectl -n trimtab create secret generic {TOKEN_SECRET} "
            f'--from-literal=token="$(openssl rand -hex 32)"') in readme


def test_trimtab_itself_refuses_to_start_without_the_token_file():
    auth = trimtab_config().admin.auth
    assert auth.token_file is not None and not Path(auth.token_file).exists()
    with pytest.raises(ValueError, match="admin token file .* cannot be read"):
        load_token(auth.token_file, auth.token_env)


def test_deployed_admin_api_closes_mutations_without_the_token_and_serves_scrapes():
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from xds_server.admin.api import AdminApi
    from xds_server.control.controller import Controller
    from xds_server.xds.cache import SnapshotCache

    config = trimtab_config()

    async def scenario() -> dict[str, int]:
        controller = Controller(config, SnapshotCache())
        api = AdminApi(controller, lambda: True, token="t0ken",
                       protect_reads=config.admin.auth.protect_reads)
        try:
            async with TestClient(TestServer(api.app())) as client:
                pause = "/v1/rollouts/llama3-8b/pause"
                return {
                    "post": (await client.post(pause)).status,
                    "post wrong": (await client.post(pause, headers={
                        "Authorization": "Bearer nope"})).status,
                    "post token": (await client.post(pause, json={}, headers={
                        "Authorization": "Bearer t0ken"})).status,
                    "metrics": (await client.get("/metrics")).status,
                    "healthz": (await client.get("/healthz")).status,
                }
        finally:
            await controller.close()

    statuses = asyncio.run(scenario())
    assert statuses["post"] == statuses["post wrong"] == 401
    assert statuses["post token"] == 404  # past the token check: the pool has no rollout
    assert statuses["metrics"] == statuses["healthz"] == 200  # Prometheus and probes


def _policy_peers(peer: dict[str, Any]) -> tuple[str, str]:
    """('pods', app name) for a same-namespace pod selector, ('namespace', name) for a
    namespace selector; nothing broader is allowed in this policy."""
    assert set(peer) <= {"podSelector", "namespaceSelector"} and "ipBlock" not in peer, peer
    if "namespaceSelector" in peer:
        assert "podSelector" not in peer, peer
        labels = peer["namespaceSelector"]["matchLabels"]
        assert set(labels) == {"kubernetes.io/metadata.name"}, peer  # set by Kubernetes itself
        return "namespace", labels["kubernetes.io/metadata.name"]
    labels = peer["podSelector"]["matchLabels"]
    assert labels, f"an empty podSelector admits every pod: {peer}"
    return "pods", labels["app.kubernetes.io/name"]


def _container_port_number(workload: dict[str, Any], port: int | str) -> int:
    ports = [p for c in containers(workload) for p in c.get("ports", [])]
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in ports if p["name"] == port]
    return int(number)


def test_networkpolicy_admits_xds_only_from_envoy_and_admin_only_from_monitoring():
    policy = find("NetworkPolicy", "trimtab")
    trimtab = find("Deployment", "trimtab")
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= \
        trimtab["spec"]["template"]["metadata"]["labels"].items()
    selected = [w["metadata"]["name"] for w in workloads()
                if spec["podSelector"]["matchLabels"].items()
                <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert selected == ["trimtab"]
    assert spec["policyTypes"] == ["Ingress"]
    admitted: dict[int, set[tuple[str, str]]] = {}
    for rule in spec["ingress"]:
        assert rule.get("from") and rule.get("ports"), f"a rule without from/ports admits all: {rule}"
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            number = _container_port_number(trimtab, port["port"])
            admitted.setdefault(number, set()).update(_policy_peers(p) for p in rule["from"])
    config = trimtab_config()
    xds, admin = config.xds.host_port.port, config.admin.host_port.port
    keda = parse_host_port(config.keda.address).port  # type: ignore[arg-type]
    assert admitted == {xds: {("pods", "envoy")}, admin: {("namespace", "monitoring")},
                        keda: {("namespace", "keda")}}
    # the Envoy pod selector picks the Envoy Deployment and nothing else
    envoys = [w["metadata"]["name"] for w in workloads()
              if w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name")
              == "envoy"]
    assert envoys == ["envoy"]
    # every port the trimtab Service exposes is fenced by the policy
    for entry in find("Service", "trimtab")["spec"]["ports"]:
        assert _container_port_number(trimtab, entry["targetPort"]) in admitted, entry


# -- the mTLS overlay --------------------------------------------------------------------

CERT_MANAGER = "cert-manager.io/v1"


def _by_name(rendered: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in rendered if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _configmap_file(rendered: list[dict[str, Any]], name: str, key: str) -> str:
    return str(_by_name(rendered, "ConfigMap", name)["data"][key])


def test_mtls_overlay_renders_the_base_plus_certificates_and_an_issuer():
    base = {(d["kind"], d["metadata"]["name"]) for d in render(DEPLOY)}
    rendered = render(MTLS)
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert names == base | {("Issuer", "trimtab-selfsigned"), ("Issuer", "trimtab-ca"),
                            ("Certificate", "trimtab-ca"), ("Certificate", "trimtab-xds"),
                            ("Certificate", "envoy-xds-client")}
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "trimtab", doc["metadata"]
    for doc in rendered:
        if doc["kind"] == "Certificate":
            assert doc["apiVersion"] == CERT_MANAGER
            ref = doc["spec"]["issuerRef"]
            assert ref["group"] == "cert-manager.io" and ref["kind"] == "Issuer"
            _by_name(rendered, "Issuer", ref["name"])  # the issuer it names is there
    ca_issuer = _by_name(rendered, "Issuer", "trimtab-ca")
    ca_cert = _by_name(rendered, "Certificate", "trimtab-ca")
    assert ca_cert["spec"]["isCA"] and ca_issuer["spec"]["ca"]["secretName"] == \
        ca_cert["spec"]["secretName"]
    for leaf in ("trimtab-xds", "envoy-xds-client"):
        assert _by_name(rendered, "Certificate", leaf)["spec"]["issuerRef"]["name"] == "trimtab-ca"
    # the base's safety carries over unchanged
    assert _by_name(rendered, "NetworkPolicy", "trimtab") == _by_name(
        render(DEPLOY), "NetworkPolicy", "trimtab")


def _mtls_trimtab_config(rendered: list[dict[str, Any]]):
    return parse_config(yaml.safe_load(_configmap_file(rendered, "trimtab-config",
                                                       "config.yaml")))


def test_mtls_overlay_trimtab_config_requires_client_certificates_that_bind_the_cluster():
    rendered = render(MTLS)
    config = _mtls_trimtab_config(rendered)
    tls, nodes = config.xds.tls, config.nodes
    assert tls is not None and tls.require_client_cert and tls.reload
    assert nodes is not None and nodes.require_san_match and nodes.require_cluster_binding
    assert "*" not in nodes.clusters  # a node of any other cluster is refused
    # the files are the Secret cert-manager writes for the trimtab-xds Certificate
    deployment = _by_name(rendered, "Deployment", "trimtab")
    secret = _by_name(rendered, "Certificate", "trimtab-xds")["spec"]["secretName"]
    for path, key in ((tls.cert_file, "tls.crt"), (tls.key_file, "tls.key"),
                      (tls.client_ca_file, "ca.crt")):
        source, found = _secret_file(deployment, str(path))
        assert (source["secretName"], found) == (secret, key)
        _fails_closed(source, deployment)
    # everything else is the base config, so the two cannot drift apart
    same = {"xds": config.xds.model_copy(update={"tls": None}), "nodes": None}
    assert config.model_copy(update=same) == trimtab_config()
    # the overlay's file loads with trimtab's own loader too
    assert load_config(MTLS / "config" / "trimtab.yaml") == config


def _mtls_bootstrap(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(_configmap_file(rendered, "envoy-bootstrap", "envoy.yaml"))


def _tls_context(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (cluster,) = bootstrap["static_resources"]["clusters"]
    socket = cluster["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    context = socket["typed_config"]
    assert context["@type"].endswith("tls.v3.UpstreamTlsContext")
    return context


def test_mtls_overlay_envoy_bootstrap_dials_trimtab_over_mtls_and_checks_its_name():
    rendered = render(MTLS)
    bootstrap = _mtls_bootstrap(rendered)
    context = _tls_context(bootstrap)
    server_names = set(_by_name(rendered, "Certificate", "trimtab-xds")["spec"]["dnsNames"])
    (cluster,) = bootstrap["static_resources"]["clusters"]
    dialled = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]["socket_address"]["address"]
    assert context["sni"] == dialled == TRIMTAB_DNS and dialled in server_names
    common = context["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    (matcher,) = common["validation_context"]["match_typed_subject_alt_names"]
    assert matcher["san_type"] == "DNS" and matcher["matcher"]["exact"] in server_names
    deployment = _by_name(rendered, "Deployment", "envoy")
    secret = _by_name(rendered, "Certificate", "envoy-xds-client")["spec"]["secretName"]
    # the client certificate comes by file-based SDS from a file of the bootstrap ConfigMap,
    # watching the Secret volume's directory (renewals apply without a restart)
    assert "tls_certificates" not in common
    (sds,) = common["tls_certificate_sds_secret_configs"]
    source = sds["sds_config"]["path_config_source"]
    mount, _, key = source["path"].rpartition("/")
    assert _configmap_mounts(deployment)[mount] == "envoy-bootstrap"
    resources = yaml.safe_load(_configmap_file(rendered, "envoy-bootstrap", key))["resources"]
    (resource,) = resources
    assert resource["@type"].endswith("tls.v3.Secret") and resource["name"] == sds["name"]
    pair = resource["tls_certificate"]
    watched = {source["watched_directory"]["path"], pair["watched_directory"]["path"]}
    for path, key in ((pair["certificate_chain"]["filename"], "tls.crt"),
                      (pair["private_key"]["filename"], "tls.key"),
                      (common["validation_context"]["trusted_ca"]["filename"], "ca.crt")):
        volume, found = _secret_file(deployment, path)
        assert (volume["secretName"], found) == (secret, key)
        _fails_closed(volume, deployment)
        assert watched == {path.rpartition("/")[0]}  # the Secret's mount directory
    # only the transport socket differs from the base bootstrap
    plain = copy.deepcopy(bootstrap)
    del plain["static_resources"]["clusters"][0]["transport_socket"]
    assert plain == envoy_bootstrap()


def test_mtls_overlay_envoy_certificate_proves_exactly_its_node_cluster():
    """The §3 SAN rule applied to the overlay: the Envoy Deployment's shared certificate
    proves node cluster trimtab-envoy, whatever pod name is the node id, and nothing else."""
    from envoy.config.core.v3.base_pb2 import Node

    from xds_server.security.authz import NodeAuthorizer
    from xds_server.security.identity import san_binding

    rendered = render(MTLS)
    config = _mtls_trimtab_config(rendered)
    spec = _by_name(rendered, "Certificate", "envoy-xds-client")["spec"]
    sans = list(spec.get("uris", [])) + list(spec.get("dnsNames", []))
    assert sans and set(spec["usages"]) >= {"client auth"}
    cluster = _mtls_bootstrap(rendered)["node"]["cluster"]
    assert cluster in config.nodes.clusters  # type: ignore[union-attr]
    auth = NodeAuthorizer.from_config(config.nodes)
    for pod in ("envoy-7d9f8-abcde", "envoy-7d9f8-xyz12"):
        decision = auth.authorize(Node(id=pod, cluster=cluster), sans)
        assert decision.allowed and decision.pools is None, decision
        assert {san_binding(s, pod, cluster, config.nodes.trust_domain) for s in sans} == {
            "cluster"}
    for other in ("trimtab-envoy.eu", "trimtab", "edge-a"):
        assert not auth.authorize(Node(id="envoy-1", cluster=other), sans).allowed, other
    assert "server auth" in _by_name(rendered, "Certificate", "trimtab-xds")["spec"]["usages"]


class SecretVolume:
    """A directory laid out as the kubelet writes a Secret volume: each file is a symlink
    into ``..data``, a symlink to a timestamped directory that an update swaps atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.updates = 0
        path.mkdir(parents=True)

    def install(self, files: dict[str, bytes]) -> None:
        import os

        self.updates += 1
        version = self.path / f"..2026_01_01_00_00_{self.updates:02d}"
        version.mkdir()
        for name, data in files.items():
            (version / name).write_bytes(data)
        os.symlink(version.name, self.path / "..data_tmp")
        os.replace(self.path / "..data_tmp", self.path / "..data")
        for name in files:
            if not (self.path / name).is_symlink():
                os.symlink(f"..data/{name}", self.path / name)


def _envoy_tls_files(ca: Any, leaf: Any) -> dict[str, bytes]:
    return {"tls.crt": leaf.cert_pem, "tls.key": leaf.key_pem, "ca.crt": ca.path.read_bytes()}


def _mount_overlay_envoy(rendered: list[dict[str, Any]], root: Path, tls: dict[str, bytes]
                         ) -> tuple[dict[str, Any], SecretVolume]:
    """The overlay's Envoy files as the pod sees them, under `root`: the envoy-bootstrap
    ConfigMap at <root>/etc/envoy, the Secret volume (holding `tls`) at <root>/etc/envoy-tls.
    Returns the bootstrap with only those two path prefixes rewritten, and the volume."""
    def moved(text: str) -> str:
        return text.replace("/etc/envoy-tls", f"{root}/etc/envoy-tls").replace(
            "/etc/envoy/", f"{root}/etc/envoy/")

    config = root / "etc" / "envoy"
    config.mkdir(parents=True)
    for key, text in _by_name(rendered, "ConfigMap", "envoy-bootstrap")["data"].items():
        (config / key).write_text(moved(text))
    volume = SecretVolume(root / "etc" / "envoy-tls")
    volume.install(tls)
    return yaml.safe_load((config / "envoy.yaml").read_text()), volume


def _test_pki(tmp_path: Path) -> tuple[Any, Any]:
    from tests.support.certs import TestCA

    ca = TestCA.create(tmp_path / "pki")
    return ca, ca.issue("envoy", uris=["spiffe://trimtab/cluster/trimtab-envoy"])


def test_mtls_overlay_envoy_bootstrap_passes_envoy_validate(tmp_path: Path):
    rendered = render(MTLS)
    ca, leaf = _test_pki(tmp_path)
    bootstrap, _ = _mount_overlay_envoy(rendered, tmp_path / "pod", _envoy_tls_files(ca, leaf))
    result = _envoy_validate(bootstrap)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = copy.deepcopy(bootstrap)  # the check can fail: a typo in the TLS context
    _tls_context(broken)["common_tls_context"]["validation_context"][
        "match_typed_subject_alt_names"][0]["san_type"] = "DNZ"
    assert _envoy_validate(broken).returncode != 0
    as_rendered = _envoy_validate(_mtls_bootstrap(rendered))  # without the pod's files
    assert as_rendered.returncode != 0 and "/etc/envoy" in as_rendered.stdout + \
        as_rendered.stderr


@pytest.mark.slow
def test_mtls_overlay_envoy_reaches_trimtab_with_the_overlays_names_and_sans(tmp_path: Path):
    """A real Envoy on the overlay's bootstrap (only file paths, ports and the resolved
    address swapped) against trimtab's guarded xDS server with the overlay's tls and nodes
    settings, both certificates carrying the SANs of the overlay's Certificate resources; a
    renewal of the Secret reaches Envoy without a restart; the same certificate claiming
    another cluster is refused."""
    import asyncio

    from tests.security.test_security import CONFIG, published, with_free_listener
    from tests.support.certs import TestCA
    from trimtab_dev.envoy_process import EnvoyProcess, free_port
    from xds_server.security.authz import NodeAuthorizer
    from xds_server.security.guard import XdsGuard
    from xds_server.security.tls import server_credentials
    from xds_server.xds.server import XdsServicer, start_xds_server

    rendered = render(MTLS)
    config = _mtls_trimtab_config(rendered)
    server_spec = _by_name(rendered, "Certificate", "trimtab-xds")["spec"]
    client_spec = _by_name(rendered, "Certificate", "envoy-xds-client")["spec"]
    ca = TestCA.create(tmp_path / "pki")
    server = ca.issue("trimtab", dns=server_spec["dnsNames"])
    client = ca.issue("envoy", uris=client_spec["uris"])
    renewed = ca.issue("envoy-renewed", uris=client_spec["uris"])
    pods = iter(range(10))
    _, cache = published(with_free_listener(CONFIG))
    guard = XdsGuard(NodeAuthorizer.from_config(config.nodes))
    assert config.xds.tls is not None

    def bootstrap(port: int, cluster: str) -> tuple[dict[str, Any], SecretVolume]:
        out, volume = _mount_overlay_envoy(rendered, tmp_path / f"pod-{next(pods)}",
                                           _envoy_tls_files(ca, client))
        (xds,) = out["static_resources"]["clusters"]
        xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"] = {"address": "127.0.0.1", "port_value": port}
        out["node"] = {"id": "envoy-7d9f8-abcde", "cluster": cluster}
        out["admin"]["address"]["socket_address"] = {"address": "127.0.0.1",
                                                     "port_value": free_port()}
        return out, volume

    def clusters(envoy: EnvoyProcess) -> list[str]:
        names = [s["name"] for s in envoy.clusters_json().get("cluster_statuses", [])]
        return sorted(n for n in names if n != "xds_cluster")

    def serials(envoy: EnvoyProcess) -> set[int]:
        # Envoy prints serials as hex zero-padded to whole bytes ("08ea…"): compare numbers
        certs = json.loads(envoy.admin_get("/certs"))["certificates"]
        return {int(c["serial_number"], 16) for cert in certs for c in cert.get("cert_chain", [])}

    def serial(files: Any) -> int:
        from cryptography import x509

        return int(x509.load_pem_x509_certificate(files.cert_pem).serial_number)

    async def scenario() -> tuple[list[str], int, int, set[int], set[int]]:
        credentials = server_credentials(str(server.cert), str(server.key), str(ca.path),
                                         config.xds.tls.require_client_cert)  # type: ignore[union-attr]
        grpc_server, port = await start_xds_server(XdsServicer(cache, guard=guard),
                                                   "127.0.0.1:0", credentials=credentials)
        own, other = EnvoyProcess(), EnvoyProcess()
        try:
            cluster = _mtls_bootstrap(rendered)["node"]["cluster"]
            own_boot, own_volume = bootstrap(port, cluster)
            await asyncio.to_thread(own.start, own_boot)
            await asyncio.to_thread(own.wait_ready, 20)
            served = clusters(own)
            handshakes = own.stat("cluster.xds_cluster.ssl.handshake") or 0
            before = serials(own)
            own_volume.install(_envoy_tls_files(ca, renewed))  # cert-manager renews
            await wait_until_async(lambda: serial(renewed) in serials(own), 10.0,
                                   "Envoy to load the renewed certificate", every=0.05)
            after = serials(own)
            await asyncio.to_thread(other.start, bootstrap(port, cluster + ".eu")[0])
            await asyncio.to_thread(other.wait_admin, 20)
            await wait_until_async(lambda: guard.denied["permission"], 10.0,
                                   "the guard to deny the other cluster", every=0.05)
            assert clusters(other) == []
            return served, handshakes, guard.denied["permission"], before, after
        finally:
            await asyncio.to_thread(own.stop)
            await asyncio.to_thread(other.stop)
            await grpc_server.stop(None)

    served, handshakes, denied, before, after = asyncio.run(scenario())
    # the renewed client certificate replaced the old one without a restart (file SDS)
    assert serial(client) in before and serial(renewed) not in before
    assert serial(renewed) in after and serial(client) not in after
    expected = {name for pool in CONFIG.pools for name, _, _ in pool.clusters()}
    assert handshakes > 0 and expected <= set(served), served
    assert denied >= 1  # the same certificate claiming cluster trimtab-envoy.eu
