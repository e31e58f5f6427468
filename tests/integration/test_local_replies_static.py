"""No healthy host at all (UH) with trimtab's generated listener: a pool whose cluster has no
endpoint. trimtab never publishes such a pool over EDS (a pool needs endpoints, and Envoy's
panic threshold still tries unhealthy ones), so the listener and routes trimtab builds are run
as a static Envoy config with that cluster left empty."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from trimtab_dev.envoy_process import EnvoyProcess, free_port
from xds_server.config.load import parse_config
from xds_server.envoy.routes import build_listener, build_route_config

pytestmark = pytest.mark.slow

RETRY_AFTER_S = 11
STATIC_BODY = '{"choices": [{"message": {"role": "assistant", "content": "later"}}]}'


def _dict(message: Any) -> dict[str, Any]:
    """Plain dicts (MessageToDict gives OrderedDicts for Any, which YAML cannot write)."""
    return json.loads(json_format.MessageToJson(message, preserving_proto_field_name=True))


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    config = parse_config({
        "listener": {"local_replies": {"retry_after_seconds": RETRY_AFTER_S}},
        "pools": [{"name": "empty", "model": "m-empty", "endpoints": [{"address": "10.0.0.1:1"}]},
                  {"name": "quiet", "model": "m-quiet", "endpoints": [{"address": "10.0.0.2:1"}],
                   "static_response": {"body": STATIC_BODY}}]})
    port, admin = free_port(), free_port()
    listener = _dict(build_listener(config))
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=port)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    del hcm["rds"]
    hcm["route_config"] = _dict(build_route_config(config))
    clusters = [{"name": name, "type": "STATIC", "connect_timeout": "1s",
                 "load_assignment": {"cluster_name": name, "endpoints": []}}
                for name in ("empty", "quiet")]
    bootstrap = {"admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                          "port_value": admin}}},
                 "static_resources": {"listeners": [listener], "clusters": clusters}}
    workdir = tmp_path_factory.mktemp("local-replies")
    process = EnvoyProcess(admin_port=admin, extra_args=["--concurrency", "1"])
    process.start(bootstrap, workdir / "envoy.log")
    try:
        process.wait_ready()
        yield port
    finally:
        pid = process.pid
        process.stop()
        assert pid is None or not Path(f"/proc/{pid}").exists()


def _post(port: int, body: dict[str, Any], headers: dict[str, str] | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_no_healthy_upstream_is_a_json_503_with_retry_after(envoy: int) -> None:
    status, headers, raw = _post(envoy, {"model": "m-empty", "messages": []})
    assert status == 503 and headers["content-type"] == "application/json", (status, raw)
    assert json.loads(raw)["error"]["code"] == "no_healthy_upstream"
    assert headers["retry-after"] == str(RETRY_AFTER_S)


def test_the_static_answer_replaces_no_healthy_upstream_for_its_pool_only(envoy: int) -> None:
    status, headers, raw = _post(envoy, {"model": "m-quiet", "messages": []})
    assert (status, raw.decode()) == (200, STATIC_BODY)
    assert headers["content-type"] == "application/json"
    status, _, raw = _post(envoy, {"messages": []}, {"x-model": "m-quiet"})
    assert (status, raw.decode()) == (200, STATIC_BODY)
    status, _, raw = _post(envoy, {"model": "m-quiet", "messages": []}, {"x-model": "m-empty"})
    assert status == 503 and json.loads(raw)["error"]["code"] == "no_healthy_upstream"
