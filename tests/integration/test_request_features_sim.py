"""Request features through the simulator: ``trimtab serve`` + a real Envoy + simulated vLLM
servers (a Llama-3.1-8B text fleet and a Qwen2-VL-7B fleet, profile ``qwen2-vl-7b``) driven by
the load generator with a workload of image, streamed, batch (non-streamed), long-generation
and code requests. Each answer names its server (``x-sim-server``): image requests must land on
the VL server and only there, batch requests on the batch server, long generations on the
long-generation server, code questions (the intent tier of the classifier `trimtab serve`
runs itself) on the code server, the rest on the text server."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import TrimtabProcess
from trimtab_dev.envoy_process import EnvoyProcess, free_port, render_bootstrap
from trimtab_dev.loadgen.runner import run_load
from trimtab_dev.loadgen.workload import parse_workload
from trimtab_dev.sim.fleet import SimFleet

pytestmark = pytest.mark.slow

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TEXT = {"model": MODEL, "servers": [{"name": "text", "gpu": "H100-80G", "count": 4}]}
VL = {"model": MODEL, "model_profile": "qwen2-vl-7b",  # --served-model-name as the text model
      "servers": [{"name": "vl", "gpu": "H100-80G"}]}  # one server: named "vl"
LONG = 24  # max_tokens of the long-generation class (a threshold, small to keep it fast)
SHORT = {"prompt_tokens": {"dist": "uniform", "min": 100, "max": 300},
         "max_tokens": {"dist": "fixed", "value": 4}}
WORKLOAD = {"name": "tiers-e2e", "seed": 7, "rate": 20, "duration_s": 3, "stream": True,
            "models": [{"name": MODEL}],
            "classes": [{"name": "chat", "weight": 2, **SHORT},
                        {"name": "image", "weight": 1, "images": 1, **SHORT},
                        {"name": "batch", "weight": 1, "stream": False, **SHORT},
                        {"name": "code", "weight": 1, **SHORT,
                         "text_prefix": "Write a python function that"},
                        {"name": "long", "weight": 1, **SHORT,
                         "max_tokens": {"dist": "fixed", "value": LONG}}]}


def _config(text: dict[str, str], vl: dict[str, str], ports: dict[str, int]) -> dict[str, Any]:
    def pool(name: str, address: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "model": MODEL, "endpoints": [{"address": address}], **extra}

    classes = [{"pool": "chat-vl", "modality": "image"}, {"pool": "chat-batch", "stream": False},
               {"pool": "chat-long", "max_tokens": {"min": LONG}}]
    return {"xds": {"address": f"127.0.0.1:{ports['xds']}"},
            "admin": {"address": f"127.0.0.1:{ports['admin']}"},
            "listener": {"address": f"127.0.0.1:{ports['listener']}"},
            "telemetry": {"interval_seconds": 0.5, "stale_after_seconds": 3.0},
            "classifier": {"address": f"127.0.0.1:{ports['classifier']}",  # embedded
                           "rules": [{"tier": "code", "keywords": ["python"]}]},
            "pools": [pool("chat", text["text-0"], request_classes=classes,
                           intent_tiers={"code": "chat-code"}),
                      pool("chat-vl", vl["vl"]), pool("chat-batch", text["text-1"]),
                      pool("chat-code", text["text-2"]), pool("chat-long", text["text-3"])]}


async def _scenario(workdir: Path) -> Counter[tuple[str, str | None]]:
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin",
                                            "classifier")}
    async with SimFleet(TEXT) as text, SimFleet(VL) as vl:
        config_path = workdir / "trimtab.yaml"
        config_path.write_text(yaml.safe_dump(_config(text.addresses, vl.addresses, ports)))
        trimtab = TrimtabProcess(config_path, ports["admin"], workdir / "trimtab.log")
        envoy = EnvoyProcess(extra_args=["--concurrency", "2"])
        try:
            trimtab.start()
            await asyncio.to_thread(trimtab.wait_ready)  # the sim servers keep serving meanwhile
            envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                         admin_port=ports["envoy_admin"], api="delta"),
                        workdir / "envoy.log")
            await asyncio.to_thread(envoy.wait_ready, 15.0)
            result = await run_load([f"http://127.0.0.1:{ports['listener']}"],
                                    parse_workload(WORKLOAD))
        finally:
            await asyncio.to_thread(envoy.stop)
            await asyncio.to_thread(trimtab.stop)
    failed = [r for r in result.records if r.error is not None]
    assert not failed, failed[:3]
    return Counter((r.cls, r.server) for r in result.records)


def test_image_batch_long_and_code_requests_land_on_their_simulated_pools(tmp_path: Path
                                                                           ) -> None:
    landed = asyncio.run(_scenario(tmp_path))
    by_class: dict[str, set[str | None]] = {}
    for (cls, server), _ in landed.items():
        by_class.setdefault(cls, set()).add(server)
    assert by_class == {"chat": {"text-0"}, "image": {"vl"}, "batch": {"text-1"},
                        "code": {"text-2"}, "long": {"text-3"}}, landed
    assert all(sum(n for (c, _), n in landed.items() if c == cls) >= 3 for cls in by_class)
