"""DCGM exporter metrics on a page: framebuffer use and utilisation of one GPU or the busiest."""

from __future__ import annotations

import math

from xds_server.telemetry.parsers.reader import Reader
from xds_server.telemetry.reading import valid

FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"


GpuKey = tuple[str, str]  # (gpu index label, UUID label)


def _per_gpu(r: Reader, name: str, gpu: str | None, uuid: str | None) -> dict[GpuKey, float]:
    """Value per (gpu, UUID) among the selected GPUs; duplicates keep the max (NaN wins)."""
    grouped: dict[GpuKey, list[float]] = {}
    for labels, value in r.index.get(name, []):
        key = (labels.get("gpu", ""), labels.get("UUID", ""))
        if (gpu is None or key[0] == gpu) and (uuid is None or key[1] == uuid):
            grouped.setdefault(key, []).append(value)
    return {
        key: math.nan if any(math.isnan(v) for v in values) else max(values)
        for key, values in grouped.items()
    }


def _selection(gpu: str | None, uuid: str | None) -> str:
    parts = [f"gpu={gpu!r}" if gpu is not None else "", f"UUID={uuid!r}" if uuid else ""]
    return " ".join(p for p in parts if p) or "any GPU"


def dcgm_memory(r: Reader, gpu: str | None, uuid: str | None) -> float | None:
    """Framebuffer use in percent of the selected GPU, or of the busiest one."""
    if FB_USED not in r.index and FB_FREE not in r.index:
        return None
    used, free = _per_gpu(r, FB_USED, gpu, uuid), _per_gpu(r, FB_FREE, gpu, uuid)
    if not used and not free:
        r.reject("gpu_mem_pct", "DCGM", f"has no series for {_selection(gpu, uuid)}")
        return None
    if used.keys() != free.keys():
        unpaired = sorted(used.keys() ^ free.keys())
        r.reject("gpu_mem_pct", f"{FB_USED}/{FB_FREE}", f"not paired for {unpaired}")
        return None
    best: float | None = None
    for key in sorted(used):
        u, f = used[key], free[key]
        if not (valid(u, 0.0, math.inf) and valid(f, 0.0, math.inf)) or u + f == 0:
            r.reject("gpu_mem_pct", f"{FB_USED}/{FB_FREE}", f"are {u!r}/{f!r} for {key}")
            return None
        pct = 100.0 * u / (u + f)
        best = pct if best is None else max(best, pct)
    return best


def dcgm_util(r: Reader, gpu: str | None, uuid: str | None) -> float | None:
    if GPU_UTIL not in r.index:
        return None
    values = _per_gpu(r, GPU_UTIL, gpu, uuid)
    if not values:
        r.reject("gpu_util_pct", GPU_UTIL, f"has no series for {_selection(gpu, uuid)}")
        return None
    bad = [v for v in values.values() if not valid(v, 0.0, 100.0)]
    if bad:
        r.reject("gpu_util_pct", GPU_UTIL, f"is {bad[0]!r}, outside (0, 100)")
        return None
    return max(values.values())
