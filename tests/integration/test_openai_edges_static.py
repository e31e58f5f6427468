"""What an OpenAI client meets at trimtab's listener, answered by a real Envoy 1.40 itself:
``GET /v1/models`` (and ``/v1/models/{id}``), a body that is not JSON, a body without a
content type (or curl -d's form type), an unknown model named in the 404. trimtab's listener and
routes run as a static Envoy config in front of recording servers, so every test also checks
which server saw the request, and that none saw what Envoy must answer."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from trimtab_dev.envoy_process import EnvoyProcess, free_port
from xds_server.config.load import parse_config
from xds_server.envoy.routes import build_listener, build_route_config

pytestmark = pytest.mark.slow

MODELS = ["m-a", "org/m-b", "50%-off"]  # a slash and a percent sign in served names
JSON_CT = {"content-type": "application/json"}
FORM_CT = {"content-type": "application/x-www-form-urlencoded"}  # curl -d's default


@dataclass
class Recorder:
    """A model server that records what reaches it (path, content type, body)."""

    name: str
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    def start(self) -> Recorder:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                recorder.seen.append((self.path, self.headers.get("content-type", ""), body))
                raw = json.dumps({"backend": recorder.name}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.server_address[1]

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _dict(message: Any) -> dict[str, Any]:
    return json.loads(json_format.MessageToJson(message, preserving_proto_field_name=True))


@dataclass
class Edge:
    port: int
    recorders: dict[str, Recorder]

    def seen(self) -> int:
        return sum(len(r.seen) for r in self.recorders.values())


def _run(models: list[str], workdir: Path) -> Iterator[Edge]:
    recorders = {model: Recorder(model).start() for model in models}
    pools: list[dict[str, Any]] = [
        {"name": f"p{i}", "model": model,
         "endpoints": [{"address": f"127.0.0.1:{recorders[model].port}"}]}
        for i, model in enumerate(models)]
    config = parse_config({"pools": pools})
    port, admin = free_port(), free_port()
    listener = _dict(build_listener(config))
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=port)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    del hcm["rds"]
    hcm["route_config"] = _dict(build_route_config(config))
    clusters = [{"name": pool["name"], "type": "STATIC", "connect_timeout": "1s",
                 "load_assignment": {"cluster_name": pool["name"], "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": {"socket_address": {
                         "address": "127.0.0.1", "port_value": recorders[pool["model"]].port}}}}]}]}}
                for pool in pools]
    bootstrap = {"admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                          "port_value": admin}}},
                 "static_resources": {"listeners": [listener], "clusters": clusters}}
    process = EnvoyProcess(admin_port=admin, extra_args=["--concurrency", "1"])
    try:
        process.start(bootstrap, workdir / "envoy.log")
        process.wait_ready()
        yield Edge(port, recorders)
    finally:
        process.stop()
        for recorder in recorders.values():
            recorder.stop()


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    yield from _run(MODELS, tmp_path_factory.mktemp("edges"))


@pytest.fixture(scope="module")
def one_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    yield from _run(["solo"], tmp_path_factory.mktemp("edges-one"))


def _send(edge: Edge, method: str, path: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for key, value in (headers or {}).items():  # no content-type unless given
            conn.putheader(key, value)
        if body is not None:
            conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type") or "", resp.read()
    finally:
        conn.close()


def _error(edge: Edge, status: int, method: str, path: str, body: bytes | None = None,
           headers: dict[str, str] | None = None) -> dict[str, Any]:
    """An answer Envoy gives itself: that status, an OpenAI error object, no server saw it."""
    before = edge.seen()
    got, ctype, raw = _send(edge, method, path, body, headers)
    assert (got, ctype) == (status, "application/json"), raw
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert edge.seen() == before, "a model server saw a request Envoy must answer"
    return error


def _models_list(models: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                        "owned_by": "trimtab"} for m in models]}


# -- GET /v1/models ---------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["pools", "one_pool"])
def test_models_list_is_answered_by_envoy(fixture: str, request: pytest.FixtureRequest) -> None:
    edge: Edge = request.getfixturevalue(fixture)
    before = edge.seen()
    status, ctype, raw = _send(edge, "GET", "/v1/models", headers={"x-model": "m-a"})
    assert (status, ctype) == (200, "application/json")
    assert json.loads(raw) == _models_list(list(edge.recorders))
    assert edge.seen() == before


def test_a_served_model_is_found_by_id_raw_or_encoded(pools: Edge) -> None:
    lookups = {"/v1/models/m-a": "m-a", "/v1/models/org/m-b": "org/m-b",
               "/v1/models/org%2Fm-b": "org/m-b", "/v1/models/50%25-off": "50%-off"}
    before = pools.seen()
    for path, model in lookups.items():
        status, ctype, raw = _send(pools, "GET", path)
        assert (status, ctype) == (200, "application/json"), path
        assert json.loads(raw) == {"id": model, "object": "model", "created": 0,
                                   "owned_by": "trimtab"}
    assert pools.seen() == before


def test_an_unknown_model_id_is_a_404_naming_the_path(pools: Edge) -> None:
    error = _error(pools, 404, "GET", "/v1/models/gpt-4o")
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "/v1/models/gpt-4o" in error["message"]
    assert "m-a, org/m-b, 50%-off" in error["message"]  # the served list, % kept literal


# -- bodies that are not JSON ----------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["pools", "one_pool"])
@pytest.mark.parametrize(("body", "headers"), [
    (b'{"model": "m-a", "messages": [{"role": "user", "con', JSON_CT),  # truncated
    (b'{"model": "m-a"', {}),  # no content type: read as JSON
    (b"model=m-a&messages=hi", FORM_CT),  # a real form
    (b"{'model': 'm-a'}", {**JSON_CT, "x-model": "m-a"}),  # the header does not excuse it
])
def test_a_body_that_is_not_json_is_a_400(fixture: str, body: bytes, headers: dict[str, str],
                                          request: pytest.FixtureRequest) -> None:
    edge: Edge = request.getfixturevalue(fixture)
    error = _error(edge, 400, "POST", "/v1/chat/completions", body, headers)
    assert error["code"] == "invalid_json" and "not valid JSON" in error["message"]


def test_a_body_of_another_content_type_is_not_judged(pools: Edge, one_pool: Edge) -> None:
    """A multipart upload (audio) is not JSON and not claimed to be: it passes."""
    multipart = {"content-type": "multipart/form-data; boundary=x"}
    body = b'--x\r\ncontent-disposition: form-data; name="model"\r\n\r\nm-a\r\n--x--\r\n'
    status, _, raw = _send(pools, "POST", "/v1/audio/transcriptions", body,
                           {**multipart, "x-model": "org/m-b"})
    assert (status, json.loads(raw)) == (200, {"backend": "org/m-b"})
    status, _, raw = _send(one_pool, "POST", "/v1/audio/transcriptions", body, multipart)
    assert (status, json.loads(raw)) == (200, {"backend": "solo"})
    assert pools.recorders["org/m-b"].seen[-1][1] == multipart["content-type"]  # untouched


# -- content types that are read as JSON -----------------------------------------------------


@pytest.mark.parametrize("headers", [{}, FORM_CT, {"content-type": "application/json; charset=utf-8"}])
def test_a_json_body_without_json_content_type_is_routed_as_json(pools: Edge,
                                                                 headers: dict[str, str]) -> None:
    body = json.dumps({"model": "org/m-b", "messages": []}).encode()
    status, _, raw = _send(pools, "POST", "/v1/chat/completions", body, headers)
    assert (status, json.loads(raw)) == (200, {"backend": "org/m-b"})
    path, ctype, seen = pools.recorders["org/m-b"].seen[-1]
    assert (path, ctype, seen) == ("/v1/chat/completions", "application/json", body)


def test_with_two_pools_a_json_body_without_model_is_still_model_required(pools: Edge) -> None:
    error = _error(pools, 400, "POST", "/v1/chat/completions", b'{"messages": []}')
    assert error["code"] == "model_required"


def test_with_one_pool_a_json_body_without_model_goes_to_it(one_pool: Edge) -> None:
    status, _, raw = _send(one_pool, "POST", "/v1/chat/completions", b'{"messages": []}', FORM_CT)
    assert (status, json.loads(raw)) == (200, {"backend": "solo"})
    assert one_pool.recorders["solo"].seen[-1][1] == FORM_CT["content-type"]  # no model: as sent


# -- unknown models ---------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["pools", "one_pool"])
@pytest.mark.parametrize("name", ["gpt-4o", 'we"ird\\name\u00e9 %REQ(:path)%'])
def test_an_unknown_model_is_a_404_that_names_it_and_lists_the_served(
        fixture: str, name: str, request: pytest.FixtureRequest) -> None:
    edge: Edge = request.getfixturevalue(fixture)
    served = ", ".join(edge.recorders)
    body = json.dumps({"model": name, "messages": []}).encode()
    error = _error(edge, 404, "POST", "/v1/chat/completions", body, JSON_CT)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert f"`{name}`" in error["message"] and f"Served models: {served}." in error["message"]


def test_an_unknown_model_in_the_header_is_named_over_the_body(pools: Edge) -> None:
    body = json.dumps({"model": "m-a"}).encode()
    error = _error(pools, 404, "POST", "/v1/chat/completions", body,
                   {**JSON_CT, "x-model": 'hdr"model'})
    assert error["code"] == "model_not_found" and '`hdr"model`' in error["message"]
