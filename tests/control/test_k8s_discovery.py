"""EndpointSlice discovery against an in-process fake Kubernetes API server."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes.client.models import V1EndpointSlice

from tests.support.fake_kube import FakeKube, endpoint, endpoint_slice
from tests.support.wait import wait_until_async
from xds_server.control.discovery.kubernetes import (
    Backoff,
    DiscoveredEndpoint,
    EndpointSliceWatcher,
    endpoints_of_slice,
    make_api_client,
    merge_endpoints,
    watch_endpoint_slices,
)
from xds_server.envoy.clusters import DRAINING, HEALTHY

SERVICE = "llm"
FAST = Backoff(base_s=0.01, cap_s=0.05)


@dataclass(frozen=True)
class RecordingBackoff(Backoff):
    delays: list[float] = field(default_factory=list)

    def delay(self, attempt: int) -> float:
        value = super().delay(attempt)
        self.delays.append(value)
        return value


def _slice(name: str, *endpoints: dict[str, Any], ports: list[dict[str, Any]] | None = None,
           service: str = SERVICE, address_type: str = "IPv4") -> dict[str, Any]:
    return endpoint_slice(name, service, list(endpoints), ports, address_type=address_type)


def _model(obj: dict[str, Any]) -> V1EndpointSlice:
    model = V1EndpointSlice.from_dict(obj)
    assert model is not None
    return model


def _addresses(endpoints: tuple[DiscoveredEndpoint, ...]) -> list[str]:
    return [e.address for e in endpoints]


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake
    leftovers = [t.name for t in threading.enumerate() if t.name.startswith("k8s-endpoint")]
    assert leftovers == []


@contextlib.asynccontextmanager
async def _watching(kube: FakeKube, port_name: str | None = "http",
                    **options: Any) -> AsyncIterator[EndpointSliceWatcher]:
    api_client = make_api_client(kube.host)
    options.setdefault("backoff", FAST)
    watcher = watch_endpoint_slices("default", SERVICE, port_name, api_client=api_client,
                                    watch_timeout_s=30, **options)
    watcher.start()
    try:
        await watcher.wait_synced(5)
        yield watcher
    finally:
        await watcher.aclose()
        api_client.close()


# -- mapping (no server) ---------------------------------------------------------------------

def test_conditions_map_to_health_and_not_serving_is_excluded() -> None:
    obj = _slice("s", endpoint("10.0.0.1", ready=True, serving=True, terminating=False,
                               zone="zone-a", node="node-1"),
                 endpoint("10.0.0.2", ready=False, serving=True, terminating=True),
                 endpoint("10.0.0.3", ready=False, serving=False, terminating=True),
                 endpoint("10.0.0.4", ready=None),  # every condition nil: ready
                 endpoint("10.0.0.5", ready=False),  # serving nil defers to ready
                 endpoint("10.0.0.6", ready=True, serving=True, terminating=True))
    found = {e.address: e for e in endpoints_of_slice(_model(obj), "http")}
    health = {address: e.health for address, e in found.items()}
    assert health == {"10.0.0.1:8000": HEALTHY, "10.0.0.2:8000": DRAINING,
                      "10.0.0.3:8000": None, "10.0.0.4:8000": HEALTHY,
                      "10.0.0.5:8000": None, "10.0.0.6:8000": DRAINING}
    assert found["10.0.0.1:8000"] == DiscoveredEndpoint("10.0.0.1:8000", True, True, False,
                                                        "zone-a", "node-1")
    assert found["10.0.0.2:8000"].terminating and not found["10.0.0.2:8000"].ready
    merged = merge_endpoints([found.values()])
    assert _addresses(merged) == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.4:8000",
                                  "10.0.0.6:8000"]


def test_port_selection_by_name_and_single_unnamed_port() -> None:
    ports = [{"name": "metrics", "port": 9400}, {"name": "http", "port": 8000}]
    two = _model(_slice("s", endpoint("10.0.0.1"), ports=ports))
    assert _addresses(tuple(endpoints_of_slice(two, "http"))) == ["10.0.0.1:8000"]
    assert _addresses(tuple(endpoints_of_slice(two, "metrics"))) == ["10.0.0.1:9400"]
    assert endpoints_of_slice(two, None) == []  # ambiguous: skipped
    assert endpoints_of_slice(two, "grpc") == []
    one = _model(_slice("s", endpoint("10.0.0.1"), ports=[{"name": "", "port": 7000}]))
    assert _addresses(tuple(endpoints_of_slice(one, None))) == ["10.0.0.1:7000"]
    assert _addresses(tuple(endpoints_of_slice(one, ""))) == ["10.0.0.1:7000"]


def test_ipv6_formatting_fqdn_skipped_and_dedupe_prefers_healthiest() -> None:
    v6 = _model(_slice("v6", endpoint("fd00::0001"), endpoint("10.0.0.1", ready=False,
                                                             serving=True, terminating=True),
                       address_type="IPv6"))
    v4 = _model(_slice("v4", endpoint("10.0.0.1"), endpoint("10.0.0.2")))
    fqdn = _model(_slice("fq", endpoint("pod.example.com"), address_type="FQDN"))
    merged = merge_endpoints([endpoints_of_slice(s, "http") for s in (v6, v4, fqdn)])
    assert _addresses(merged) == ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::1]:8000"]
    assert [e.health for e in merged] == [HEALTHY, HEALTHY, HEALTHY]


def test_backoff_is_exponential_jittered_and_capped() -> None:
    low, high = Backoff(1.0, 30.0, rand=lambda: 0.0), Backoff(1.0, 30.0, rand=lambda: 0.999)
    assert [low.delay(n) for n in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert 0.99 < high.delay(0) < 1.0
    assert low.delay(50) == 15.0 and high.delay(50) < 30.0


# -- list + watch ----------------------------------------------------------------------------

def test_initial_list_then_added_modified_deleted(kube: FakeKube) -> None:
    kube.apply(_slice("llm-a", endpoint("10.0.0.1"), endpoint("10.0.0.2")))
    kube.apply(_slice("other-a", endpoint("10.9.9.9"), service="other"))
    seen: list[tuple[DiscoveredEndpoint, ...]] = []

    async def scenario() -> None:
        async with _watching(kube, on_change=seen.append) as watcher:
            assert _addresses(watcher.current()) == ["10.0.0.1:8000", "10.0.0.2:8000"]
            [listed] = kube.records("list")
            assert listed.label_selector == f"kubernetes.io/service-name={SERVICE}"
            await wait_until_async(lambda: len(kube.records("watch")) == 1)
            [watched] = kube.records("watch")
            assert watched.resource_version == watcher.resource_version
            assert watched.allow_bookmarks and watched.timeout_seconds == 30
            kube.apply(_slice("llm-b", endpoint("fd00::7")))
            await wait_until_async(lambda: len(watcher.current()) == 3)
            kube.apply(_slice("llm-a", endpoint("10.0.0.1", ready=False, serving=True,
                                                terminating=True)))
            await wait_until_async(lambda: len(watcher.current()) == 2)
            assert [(e.address, e.health) for e in watcher.current()] == [
                ("10.0.0.1:8000", DRAINING), ("[fd00::7]:8000", HEALTHY)]
            kube.delete("llm-a")
            await wait_until_async(lambda: _addresses(watcher.current()) == ["[fd00::7]:8000"])
            assert seen[-1] == watcher.current()
            assert len(kube.records("list")) == 1

    asyncio.run(scenario())


def test_changed_event_is_level_based(kube: FakeKube) -> None:
    async def scenario() -> None:
        async with _watching(kube) as watcher:
            assert watcher.synced and watcher.current() == ()
            watcher.changed.clear()
            for index in range(5):
                kube.apply(_slice(f"s{index}", endpoint(f"10.0.1.{index}")))
            await wait_until_async(lambda: len(watcher.current()) == 5)
            assert watcher.changed.is_set()

    asyncio.run(scenario())


def test_dropped_connection_resumes_from_last_rv_after_backoff(kube: FakeKube) -> None:
    kube.apply(_slice("s1", endpoint("10.0.0.1")))
    backoff = RecordingBackoff(base_s=0.2, cap_s=1.0)

    async def scenario() -> None:
        async with _watching(kube, backoff=backoff) as watcher:
            await wait_until_async(lambda: kube.open_watches() == 1)
            watcher.changed.clear()
            bookmark_rv = kube.bookmark()
            await wait_until_async(lambda: watcher.resource_version == bookmark_rv)
            assert not watcher.changed.is_set()  # a bookmark moves the RV, not the set
            dropped_at = time.monotonic()
            kube.drop_watches()
            kube.apply(_slice("s2", endpoint("10.0.0.2")))  # while disconnected
            await wait_until_async(lambda: len(kube.records("watch")) == 2)
            assert time.monotonic() - dropped_at >= 0.1  # waited out the backoff
            assert kube.records("watch")[1].resource_version == bookmark_rv
            assert len(backoff.delays) == 1
            await wait_until_async(lambda: len(watcher.current()) == 2)
            assert len(kube.records("list")) == 1  # caught up by the watch, not a re-list

    asyncio.run(scenario())


@pytest.mark.parametrize("form", ["http", "event"])
def test_gone_on_resume_relists_from_scratch(kube: FakeKube, form: str) -> None:
    kube.apply(_slice("s1", endpoint("10.0.0.1")))

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            await wait_until_async(lambda: kube.open_watches() == 1)
            old_rv = watcher.resource_version
            kube.fail_next("watch", 503, count=10_000)  # keep it disconnected meanwhile
            kube.drop_watches()
            kube.delete("s1")
            kube.apply(_slice("s2", endpoint("10.0.0.2")))
            kube.compact(form)  # type: ignore[arg-type]
            kube.clear_failures()
            await wait_until_async(lambda: len(kube.records("list")) == 2)
            await wait_until_async(lambda: _addresses(watcher.current()) == ["10.0.0.2:8000"])
            watches = [r.resource_version for r in kube.records("watch")]
            gone_at = max(i for i, rv in enumerate(watches) if rv == old_rv)  # got 410 Gone
            assert gone_at >= 1
            await wait_until_async(lambda: len(kube.records("watch")) > gone_at + 1)
            assert kube.records("watch")[gone_at + 1].resource_version == watcher.resource_version
            assert int(watcher.resource_version or 0) > int(old_rv or 0)

    asyncio.run(scenario())


def test_gone_error_event_on_open_watch_relists(kube: FakeKube) -> None:
    kube.apply(_slice("s1", endpoint("10.0.0.1")))

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            await wait_until_async(lambda: kube.open_watches() == 1)
            kube.expire_watches()
            await wait_until_async(lambda: len(kube.records("list")) == 2)
            await wait_until_async(lambda: kube.open_watches() == 1)
            kube.apply(_slice("s2", endpoint("10.0.0.2")))
            await wait_until_async(lambda: len(watcher.current()) == 2)

    asyncio.run(scenario())


def test_stop_is_prompt_on_an_idle_watch_and_during_backoff(kube: FakeKube) -> None:
    async def scenario() -> None:
        api_client = make_api_client(kube.host)
        watcher = EndpointSliceWatcher(api_client, "default", SERVICE, "http",
                                       watch_timeout_s=60)
        watcher.start()
        await wait_until_async(lambda: kube.open_watches() == 1)
        started = time.monotonic()
        await watcher.aclose()
        assert time.monotonic() - started < 1.0
        await wait_until_async(lambda: kube.open_watches() == 0)
        kube.fail_next("list", 500)
        sleepy = EndpointSliceWatcher(api_client, "default", SERVICE, "http",
                                      backoff=Backoff(base_s=30.0, cap_s=30.0))
        sleepy.start()
        await wait_until_async(lambda: len(kube.records("list")) == 2)
        started = time.monotonic()
        await sleepy.aclose()
        assert time.monotonic() - started < 1.0 and not sleepy.synced
        api_client.close()

    asyncio.run(scenario())


def test_factory_uses_kubeconfig_outside_a_cluster(kube: FakeKube, tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{kube.host}'}}}}]\n"
        "users: [{name: me, user: {token: secret}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: me}}]\n")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    kube.apply(_slice("s1", endpoint("10.0.0.1")))

    async def scenario() -> None:
        watcher = watch_endpoint_slices("default", SERVICE, "http", backoff=FAST)
        assert watcher.api_client.configuration.host == kube.host
        watcher.start()
        try:
            assert _addresses(await watcher.wait_synced(5)) == ["10.0.0.1:8000"]
        finally:
            await watcher.aclose()
            watcher.api_client.close()

    asyncio.run(scenario())


# -- addresses that can be no pod's (issue 26 §6) -----------------------------------------------

NO_POD = ["0.0.0.0", "::", "127.0.0.1", "127.3.2.1", "::1", "169.254.169.254", "fe80::1",
          "224.0.0.1", "ff02::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254"]


def test_unspecified_loopback_link_local_and_multicast_never_enter_the_set(
        caplog: pytest.LogCaptureFixture) -> None:
    from xds_server.control.discovery.kubernetes import RefusedAddresses

    v4 = _model(_slice("v4", endpoint("10.0.0.1"),
                       *(endpoint(a) for a in NO_POD if ":" not in a)))
    v6 = _model(_slice("v6", endpoint("fd00::1"), *(endpoint(a) for a in NO_POD if ":" in a),
                       address_type="IPv6"))
    refused = RefusedAddresses()
    with caplog.at_level("WARNING", logger="xds_server.control.discovery.kubernetes"):
        for _ in range(3):  # the same slices read again (a re-list, a MODIFIED event)
            merged = merge_endpoints([endpoints_of_slice(s, "http", refused) for s in (v4, v6)])
    assert _addresses(merged) == ["10.0.0.1:8000", "[fd00::1]:8000"]
    assert refused.total == 3 * len(NO_POD) and len(refused.addresses) == len(NO_POD)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == len(NO_POD)  # once per address, not per read
    assert "EndpointSlice 'v4': endpoint 169.254.169.254:8000 refused, never sent to Envoy: " \
           "a link-local address" in "\n".join(lines)


def test_the_watcher_refuses_them_from_the_list_and_from_events(kube: FakeKube) -> None:
    kube.apply(_slice("llm-a", endpoint("10.0.0.1"), endpoint("127.0.0.1"),
                      endpoint("0.0.0.0")))

    async def scenario() -> None:
        async with _watching(kube) as watcher:
            assert _addresses(watcher.current()) == ["10.0.0.1:8000"]
            kube.apply(_slice("llm-b", endpoint("fe80::1"), endpoint("fd00::2"),
                              address_type="IPv6"))
            await wait_until_async(lambda: len(watcher.current()) == 2)
            assert _addresses(watcher.current()) == ["10.0.0.1:8000", "[fd00::2]:8000"]
            assert watcher.refused.addresses == {"127.0.0.1:8000", "0.0.0.0:8000",
                                                 "[fe80::1]:8000"}

    asyncio.run(scenario())
