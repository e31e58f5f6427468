"""A tiny NVML metrics agent: DCGM-compatible ``/metrics`` without the DCGM exporter.

Reads every GPU through NVML on each scrape and exposes::

    DCGM_FI_DEV_FB_USED{gpu,UUID,modelName}   framebuffer used, MiB
    DCGM_FI_DEV_FB_FREE{gpu,UUID,modelName}   framebuffer free, MiB
    DCGM_FI_DEV_GPU_UTIL{gpu,UUID,modelName}  GPU utilisation, %

so :func:`xds_server.telemetry.parsers.parse_page`
read it unchanged. ``pynvml`` (package ``nvidia-ml-py``) is imported only by
:class:`PynvmlReader`. Run it with ``python -m xds_server.telemetry.nvml_agent --port 9400``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

LABELS = ("gpu", "UUID", "modelName")
_MIB = 1024 * 1024
_FAMILIES = (
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "mem_used_mib"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "mem_free_mib"),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util_pct"),
)


@dataclass(frozen=True)
class GpuStat:
    """One GPU's state at read time."""

    index: int
    uuid: str
    name: str
    mem_used_mib: float
    mem_free_mib: float
    util_pct: float


class GpuReader(Protocol):
    """Anything that can list the GPUs' current state (called from a worker thread)."""

    def read(self) -> list[GpuStat]: ...


class NvmlUnavailable(RuntimeError):
    """NVML (the ``pynvml`` module or the driver library) cannot be used."""


class StaticReader:
    """A :class:`GpuReader` returning fixed stats; assign ``stats`` to change them."""

    def __init__(self, stats: Sequence[GpuStat] = ()) -> None:
        self.stats = list(stats)
        self.reads = 0

    def read(self) -> list[GpuStat]:
        self.reads += 1
        return list(self.stats)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class PynvmlReader:
    """Reads GPUs through NVML. Initialises NVML on construction.

    Raises :class:`NvmlUnavailable` if ``pynvml`` is not installed (``pip install
    nvidia-ml-py``) or NVML cannot be initialised (no driver, no GPU visible).
    """

    def __init__(self) -> None:
        try:
            self._nvml: Any = importlib.import_module("pynvml")
        except ImportError as exc:
            raise NvmlUnavailable(
                "the pynvml module is missing: install the nvidia-ml-py package"
            ) from exc
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # pynvml.NVMLError and OSError when libnvidia-ml is absent
            raise NvmlUnavailable(f"NVML could not be initialised: {exc}") from exc

    def read(self) -> list[GpuStat]:
        nvml = self._nvml
        stats = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            stats.append(
                GpuStat(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    mem_used_mib=memory.used / _MIB,
                    mem_free_mib=memory.free / _MIB,
                    util_pct=float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                )
            )
        return stats

    def close(self) -> None:
        """Shut NVML down (the reader must not be used afterwards)."""
        self._nvml.nvmlShutdown()


class _StatsCollector(Collector):
    def __init__(self, stats: Sequence[GpuStat]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        for name, documentation, attribute in _FAMILIES:
            family = GaugeMetricFamily(name, documentation, labels=LABELS)
            for stat in self._stats:
                labels = [str(stat.index), stat.uuid, stat.name]
                family.add_metric(labels, float(getattr(stat, attribute)))
            yield family


def render(stats: Sequence[GpuStat]) -> bytes:
    """Prometheus text (format 0.0.4) with the DCGM-compatible gauges for ``stats``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats))
    return generate_latest(registry)


# --- HTTP ---------------------------------------------------------------------------------------


def build_app(reader: GpuReader) -> web.Application:
    """The agent's aiohttp app: ``GET /metrics`` (a fresh NVML read each time, in a worker
    thread; 503 with the error text if the read fails) and ``GET /healthz``."""

    async def metrics(_: web.Request) -> web.Response:
        try:
            stats = await asyncio.to_thread(reader.read)
        except Exception as exc:  # report, don't crash: the scraper records the failure
            return web.Response(status=503, text=f"GPU read failed: {type(exc).__name__}: {exc}\n")
        body = await asyncio.to_thread(render, stats)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


async def start_agent(reader: GpuReader, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (``await runner.cleanup()`` to stop) and the bound
    port (useful with ``port=0``)."""
    runner = web.AppRunner(build_app(reader), shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


async def serve_agent(reader: GpuReader, host: str, port: int,
                      stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or the task is cancelled), then stop cleanly. The reader
    stays open: its owner closes it."""
    runner, _ = await start_agent(reader, host, port)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xds_server.telemetry.nvml_agent [--host H] [--port P]``."""
    parser = argparse.ArgumentParser(description="DCGM-compatible GPU metrics from NVML")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9400)
    args = parser.parse_args(argv)
    try:
        reader = PynvmlReader()
    except NvmlUnavailable as exc:
        parser.exit(2, f"nvml_agent: {exc}\n")
    try:
        asyncio.run(serve_agent(reader, args.host, args.port))
    except KeyboardInterrupt:
        pass
    finally:
        reader.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
