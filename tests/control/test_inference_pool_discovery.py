"""InferencePool discovery (Gateway API Inference Extension, inference.networking.k8s.io/v1)
against the in-process fake Kubernetes API server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.support.fake_kube import Conflict, FakeKube, inference_pool, pod
from tests.support.wait import wait_until_async
from xds_server.config.load import ConfigError, parse_config
from xds_server.control.controller import Controller
from xds_server.control.discovery.inference_pool import (
    InferencePoolWatcher,
    PoolSpec,
    parse_pool,
    pod_state,
    pool_endpoints,
    watch_inference_pool,
)
from xds_server.control.discovery.kubernetes import Backoff, RefusedAddresses, make_api_client
from xds_server.control.discovery.merge import Discovery
from xds_server.envoy.clusters import DRAINING, HEALTHY
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache

POOL = "llama"
FAST = Backoff(base_s=0.01, cap_s=0.05)
VLLM = {"app": "vllm"}


def _addresses(watcher: InferencePoolWatcher) -> list[str]:
    return [e.address for e in watcher.current()]


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake
    leftovers = [t.name for t in threading.enumerate() if t.name.startswith("k8s-inference")]
    assert leftovers == []


@contextlib.asynccontextmanager
async def _watching(kube: FakeKube, **options: Any) -> AsyncIterator[InferencePoolWatcher]:
    api_client = make_api_client(kube.host)
    options.setdefault("backoff", FAST)
    watcher = watch_inference_pool("default", POOL, api_client=api_client, watch_timeout_s=30,
                                   **options)
    watcher.start()
    try:
        await watcher.wait_synced(5)
        yield watcher
    finally:
        await watcher.aclose()
        api_client.close()


# -- mapping (no server) ---------------------------------------------------------------------

def test_the_v1_shape_is_read_and_other_shapes_select_nothing() -> None:
    spec = parse_pool(inference_pool(POOL, {"tier": "a", "app": "vllm"}, [8000, 8001, 8000]))
    assert spec == PoolSpec("app=vllm,tier=a", (8000, 8001))
    v1alpha2 = {"selector": {"app": "vllm"}, "targetPortNumber": 8000,
                "extensionRef": {"name": "epp"}}
    refused = {
        "v1alpha2 shape": v1alpha2,
        "matchExpressions": {"selector": {"matchLabels": VLLM, "matchExpressions": []},
                             "targetPorts": [{"number": 8000}]},
        "empty matchLabels": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]},
        "a value adding a term": {"selector": {"matchLabels": {"app": "vllm,role=admin"}},
                                  "targetPorts": [{"number": 8000}]},
        "a bad key": {"selector": {"matchLabels": {"a b": "x"}}, "targetPorts": [{"number": 1}]},
        "no ports": {"selector": {"matchLabels": VLLM}, "targetPorts": []},
        "nine ports": {"selector": {"matchLabels": VLLM},
                       "targetPorts": [{"number": 8000 + i} for i in range(9)]},
        "port 0": {"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": 0}]},
        "port as text": {"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": "80"}]},
        "port true": {"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": True}]},
    }
    for case, body in refused.items():
        with pytest.raises(ValueError):
            parse_pool(inference_pool(POOL, {}, [], spec=body))
            pytest.fail(f"{case} was read")
    with pytest.raises(ValueError, match="v1 selects pods by matchLabels only"):
        parse_pool(inference_pool(POOL, {}, [], spec=refused["matchExpressions"]))
    prefixed = parse_pool(inference_pool(POOL, {"app.kubernetes.io/name": "vllm-1.0"}, [80]))
    assert prefixed.selector == "app.kubernetes.io/name=vllm-1.0"


def test_pod_conditions_map_to_health_and_ports_multiply_endpoints() -> None:
    refused = RefusedAddresses(kind="Pod")
    pods = {name: pod_state(obj, refused) for name, obj in {
        "ready": pod("ready", "10.0.0.1", VLLM),
        "unready": pod("unready", "10.0.0.2", VLLM, ready=False),
        "unscheduled": pod("unscheduled", "10.0.0.3", VLLM, ready=None),
        "draining": pod("draining", "10.0.0.4", VLLM, deleting=True),
        "dead": pod("dead", "10.0.0.5", VLLM, phase="Failed"),
        "no-ip": pod("no-ip", None, VLLM),
        "v6": pod("v6", "fd00::0005", VLLM),
        "metadata": pod("metadata", "169.254.169.254", VLLM),
    }.items()}
    assert pods["no-ip"] is None and pods["metadata"] is None
    assert refused.total == 1 and refused.addresses == {"169.254.169.254"}
    found = pool_endpoints({k: v for k, v in pods.items() if v is not None}, (8000, 9000))
    health = {e.address: e.health for e in found}
    assert health == {"10.0.0.1:8000": HEALTHY, "10.0.0.1:9000": HEALTHY,
                      "10.0.0.4:8000": DRAINING, "10.0.0.4:9000": DRAINING,
                      "[fd00::5]:8000": HEALTHY, "[fd00::5]:9000": HEALTHY}
    assert {e.node for e in found} == {"node-1"}


# -- list + watch ----------------------------------------------------------------------------

def test_selected_ready_pods_become_endpoints_and_follow_changes(kube: FakeKube) -> None:
    kube.apply(inference_pool(POOL, VLLM, [8000]))
    kube.apply(inference_pool("other", {"app": "other"}, [7000]))
    kube.apply(pod("p1", "10.0.0.1", VLLM))
    kube.apply(pod("p2", "10.0.0.2", VLLM, ready=False))
    kube.apply(pod("x1", "10.0.9.1", {"app": "other"}))
    kube.apply(pod("elsewhere", "10.0.8.1", VLLM, namespace="prod"))
    seen: list[Any] = []

    async def scenario() -> None:
        async with _watching(kube, on_change=seen.append) as watcher:
            assert _addresses(watcher) == ["10.0.0.1:8000"]
            [pool_list] = kube.records("list", "inferencepools")
            assert pool_list.field_selector == f"metadata.name={POOL}"
            [pods_list] = kube.records("list", "pods")
            assert pods_list.label_selector == "app=vllm"
            await wait_until_async(lambda: kube.open_watches() == 2)
            kube.apply(pod("p2", "10.0.0.2", VLLM))  # became ready
            await wait_until_async(lambda: len(watcher.current()) == 2)
            kube.apply(pod("p1", "10.0.0.1", VLLM, ready=False))  # became unready: leaves
            await wait_until_async(lambda: _addresses(watcher) == ["10.0.0.2:8000"])
            kube.apply(pod("p3", "10.0.0.3", VLLM))
            kube.apply(pod("p3", "10.0.0.3", VLLM, deleting=True))  # terminating: drains
            await wait_until_async(lambda: len(watcher.current()) == 2)
            assert [(e.address, e.health) for e in watcher.current()] == [
                ("10.0.0.2:8000", HEALTHY), ("10.0.0.3:8000", DRAINING)]
            kube.delete("p3", kind="Pod")  # deleted: leaves
            kube.apply(pod("p2", "10.0.0.2", {"app": "retired"}))  # relabelled: leaves
            await wait_until_async(lambda: watcher.current() == ())
            assert seen[-1] == ()
            assert len(kube.records("list", "pods")) == 1  # followed by the watch alone

    asyncio.run(scenario())


def test_selector_change_reselects_and_port_change_only_recomputes(kube: FakeKube) -> None:
    kube.apply(inference_pool(POOL, {"app": "a"}, [8000]))
    kube.apply(pod("a1", "10.0.1.1", {"app": "a"}))
    kube.apply(pod("b1", "10.0.2.1", {"app": "b"}))

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            assert _addresses(watcher) == ["10.0.1.1:8000"]
            await wait_until_async(lambda: kube.open_watches() == 2)
            kube.apply(inference_pool(POOL, {"app": "b"}, [8000]))
            await wait_until_async(lambda: _addresses(watcher) == ["10.0.2.1:8000"])
            assert [r.label_selector for r in kube.records("list", "pods")] == ["app=a", "app=b"]
            await wait_until_async(lambda: kube.open_watches() == 2)
            assert kube.records("watch", "pods")[-1].label_selector == "app=b"
            kube.apply(pod("a2", "10.0.1.2", {"app": "a"}))  # the old selection: ignored
            kube.apply(inference_pool(POOL, {"app": "b"}, [8000, 8002]))
            await wait_until_async(lambda: len(watcher.current()) == 2)
            assert _addresses(watcher) == ["10.0.2.1:8000", "10.0.2.1:8002"]
            assert len(kube.records("list", "pods")) == 2  # ports alone: no re-list

    asyncio.run(scenario())


def test_a_deleted_or_unreadable_pool_selects_nothing_until_it_is_back(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    kube.apply(pod("p1", "10.0.0.1", VLLM))

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            assert watcher.synced and watcher.current() == ()  # no such pool (yet)
            assert kube.records("list", "pods") == []  # nothing selected: no pod list
            kube.apply(inference_pool(POOL, VLLM, [8000]))
            await wait_until_async(lambda: _addresses(watcher) == ["10.0.0.1:8000"])
            with caplog.at_level(logging.WARNING):
                kube.apply(inference_pool(POOL, {}, [], spec={
                    "selector": {"matchLabels": VLLM, "matchExpressions": [
                        {"key": "tier", "operator": "In", "values": ["a"]}]},
                    "targetPorts": [{"number": 8000}]}))
                await wait_until_async(lambda: watcher.current() == ())
            assert "selects no pods: spec.selector.matchExpressions is not supported" in \
                caplog.text
            kube.apply(inference_pool(POOL, VLLM, [8000]))
            await wait_until_async(lambda: len(watcher.current()) == 1)
            kube.delete(POOL, kind="InferencePool")
            await wait_until_async(lambda: watcher.current() == ())

    asyncio.run(scenario())


@pytest.mark.parametrize("form", ["http", "event"])
def test_gone_on_resume_relists_the_pool_and_the_pods(kube: FakeKube, form: str) -> None:
    kube.apply(inference_pool(POOL, VLLM, [8000]))
    kube.apply(pod("p1", "10.0.0.1", VLLM))

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            await wait_until_async(lambda: kube.open_watches() == 2)
            old_pods_rv = watcher.pods_version
            kube.fail_next("watch", 503, count=10_000)  # keep both disconnected meanwhile
            kube.drop_watches()
            kube.delete("p1", kind="Pod")
            kube.apply(pod("p2", "10.0.0.2", VLLM))
            kube.apply(inference_pool(POOL, VLLM, [8000, 8001]))
            kube.compact(form)  # type: ignore[arg-type]
            kube.clear_failures()
            await wait_until_async(lambda: _addresses(watcher) == ["10.0.0.2:8000",
                                                                   "10.0.0.2:8001"])
            assert len(kube.records("list", "inferencepools")) == 2
            assert len(kube.records("list", "pods")) >= 2
            assert old_pods_rv in [r.resource_version for r in kube.records("watch", "pods")]
            assert int(watcher.pods_version or 0) > int(old_pods_rv or 0)

    asyncio.run(scenario())


def test_gone_error_event_on_open_watches_relists(kube: FakeKube) -> None:
    kube.apply(inference_pool(POOL, VLLM, [8000]))

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            await wait_until_async(lambda: kube.open_watches() == 2)
            kube.expire_watches()
            await wait_until_async(lambda: len(kube.records("list", "inferencepools")) == 2)
            await wait_until_async(lambda: len(kube.records("list", "pods")) == 2)
            await wait_until_async(lambda: kube.open_watches() == 2)
            kube.apply(pod("p1", "10.0.0.1", VLLM))
            await wait_until_async(lambda: _addresses(watcher) == ["10.0.0.1:8000"])

    asyncio.run(scenario())


def test_errors_back_off_and_a_stale_write_to_the_pool_changes_nothing(kube: FakeKube) -> None:
    current = kube.apply(inference_pool(POOL, VLLM, [8000]))
    kube.apply(pod("p1", "10.0.0.1", VLLM))
    kube.fail_next("list", 404, count=2, resource="inferencepools")  # e.g. CRD not yet there

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            assert _addresses(watcher) == ["10.0.0.1:8000"]
            assert len(kube.records("list", "inferencepools")) == 3
            await wait_until_async(lambda: kube.open_watches() == 2)
            kube.apply(inference_pool(POOL, VLLM, [8000]))  # someone else's write
            stale = inference_pool(POOL, {"app": "x"}, [9000])
            stale["metadata"]["resourceVersion"] = current
            with pytest.raises(Conflict) as refused:
                kube.apply(stale)
            assert refused.value.status["code"] == 409
            assert refused.value.status["reason"] == "Conflict"
            kube.apply(pod("p2", "10.0.0.2", VLLM))  # an event after it: the watch is live
            await wait_until_async(lambda: len(watcher.current()) == 2)
            assert watcher.spec == PoolSpec("app=vllm", (8000,))

    asyncio.run(scenario())


def test_addresses_that_can_be_no_pods_are_refused(kube: FakeKube) -> None:
    kube.apply(inference_pool(POOL, VLLM, [8000]))
    for index, ip in enumerate(["10.0.0.1", "127.0.0.1", "0.0.0.0", "169.254.169.254"]):
        kube.apply(pod(f"p{index}", ip, VLLM))

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            assert _addresses(watcher) == ["10.0.0.1:8000"]
            kube.apply(pod("v6-bad", "fe80::1", VLLM))
            kube.apply(pod("v6", "fd00::2", VLLM))
            kube.apply(pod("multicast", "224.0.0.1", VLLM))
            await wait_until_async(lambda: len(watcher.current()) == 2)
            assert _addresses(watcher) == ["10.0.0.1:8000", "[fd00::2]:8000"]
            await wait_until_async(lambda: len(watcher.refused.addresses) == 5)
            assert watcher.refused.addresses == {"127.0.0.1", "0.0.0.0", "169.254.169.254",
                                                 "fe80::1", "224.0.0.1"}

    asyncio.run(scenario())


# -- config and the reconcile path -----------------------------------------------------------

def _config(host: str) -> Any:
    return parse_config({"pools": [
        {"name": "gie", "model": "meta-llama/Llama-3.1-8B-Instruct", "telemetry_source": "static",
         "discovery": {"kubernetes": {"namespace": "default", "inference_pool": POOL,
                                      "api_server": host}}},
        {"name": "s", "model": "n", "endpoints": [{"address": "10.9.9.9:80"}]}]})


def test_config_takes_a_service_or_an_inference_pool() -> None:
    config = _config("http://127.0.0.1:1")
    k8s = config.pool("gie").discovery.kubernetes
    assert (k8s.inference_pool, k8s.service) == (POOL, None)
    for bad in ({"namespace": "d"},
                {"namespace": "d", "service": "vllm", "inference_pool": POOL},
                {"namespace": "d", "inference_pool": POOL, "port_name": "http"}):
        with pytest.raises(ConfigError):
            parse_config({"pools": [{"name": "p", "model": "m",
                                     "discovery": {"kubernetes": bad}}]})


def _eds(cache: SnapshotCache, cluster: str) -> dict[str, int]:
    cla = cache.snapshot.of_type(T.ENDPOINT)[cluster].message
    return {f"{e.endpoint.address.socket_address.address}:"
            f"{e.endpoint.address.socket_address.port_value}": e.health_status
            for e in cla.endpoints[0].lb_endpoints}


def test_inference_pool_endpoints_reach_eds_through_reconcile(kube: FakeKube) -> None:
    kube.apply(inference_pool(POOL, VLLM, [8000]))
    kube.apply(pod("p1", "10.1.0.1", VLLM))
    kube.apply(pod("p2", "10.1.0.2", VLLM))

    async def body() -> None:
        base = _config(kube.host)
        cache = SnapshotCache()
        controller = Controller(base, cache)
        changed = asyncio.Event()

        def apply(config: Any) -> None:
            controller.reconcile(config)
            changed.set()

        discovery = Discovery(apply)
        discovery.start(base)
        try:
            await asyncio.wait_for(changed.wait(), 10)
            assert set(_eds(cache, "gie")) == {"10.1.0.1:8000", "10.1.0.2:8000"}
            changed.clear()
            kube.apply(pod("p2", "10.1.0.2", VLLM, deleting=True))
            kube.apply(pod("p3", "10.1.0.3", VLLM))
            await wait_until_async(lambda: len(_eds(cache, "gie")) == 3, timeout=10)
            eds = _eds(cache, "gie")
            assert eds["10.1.0.2:8000"] == 3  # DRAINING
            assert controller.config.pool("gie").model == "meta-llama/Llama-3.1-8B-Instruct"
            assert set(_eds(cache, "s")) == {"10.9.9.9:80"}  # static pools untouched
        finally:
            await discovery.close()
            await controller.close()

    asyncio.run(body())
