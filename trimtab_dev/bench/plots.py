"""``bench.png``: TTFT CDFs, the request share per server, and for every policy the weight
Envoy held for each host and each server's running + waiting requests over time (so a reader
sees why one policy wins). Needs matplotlib (extras ``bench``, ``dev``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def write_png(report: Mapping[str, Any], ttfts: Mapping[str, Sequence[float]],
              path: Path) -> bool:
    """TTFT CDFs, trimtab's weights over time and the request share per server; False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    policies = list(report["policies"])
    rows = 1 + len(policies)
    fig, axes = plt.subplots(rows, 3 if rows == 1 else 2, figsize=(18, 5.5 + 3.2 * len(policies)),
                             squeeze=False)
    top = axes[0]
    _plot_cdf(top[0], ttfts)
    _plot_share(top[1], report)
    if len(top) > 2:
        _plot_weights(top[2], report)
    for row, policy in zip(axes[1:], policies, strict=True):
        _plot_policy_weights(row[0], report, policy)
        _plot_policy_inflight(row[1], report, policy)
    fig.suptitle(f"{report['config']['fleet']} x {report['config']['workload']}, seed "
                 f"{report['seed']}, {report['config']['rate']:g} req/s")
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # leave the suptitle its own line
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_cdf(ax: Any, ttfts: Mapping[str, Sequence[float]]) -> None:
    for policy, values in ttfts.items():
        vals = sorted(values)
        if vals:
            ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post",
                    label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF (measured window, successful requests)")
    ax.axhline(0.99, color="grey", lw=0.5, ls=":")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)


def _plot_weights(ax: Any, report: Mapping[str, Any]) -> None:
    series = report["policies"].get("trimtab", {}).get("trimtab_weights", {})
    for name, points in series.items():
        if points:
            ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=name)
    ax.axvline(report["config"]["warmup"], color="grey", ls="--", lw=0.8)
    ax.set_xlabel("seconds since the trimtab run started (dashed: end of warm-up)")
    ax.set_ylabel("load_balancing_weight")
    ax.set_title("trimtab weights over time" if series else "trimtab not run")
    if series:
        ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)


def _series_axes(ax: Any, report: Mapping[str, Any], series: Mapping[str, Sequence[Any]],
                 ylabel: str, title: str) -> None:
    for name in sorted(series):
        points = series[name]
        if points:
            ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=name)
    ax.axvline(report["config"]["warmup"], color="grey", ls="--", lw=0.8)
    ax.set_xlabel("seconds since the run started (dashed: end of warm-up)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if any(series.values()):
        ax.legend(fontsize="small", ncol=2)
    ax.grid(True, alpha=0.3)


def _plot_policy_weights(ax: Any, report: Mapping[str, Any], policy: str) -> None:
    """Under trimtab serve (trimtab, reference): each host's share of new requests by the
    weights and localities trimtab published; otherwise the weights Envoy held for each host
    (its /clusters), over the policy's run."""
    shares = report["policies"][policy].get("trimtab_shares")
    if shares:
        _series_axes(ax, report, shares, "% of new requests (weights, localities)",
                     f"{policy}: share each host's weight gives it")
        return
    series = report["policies"][policy].get("envoy_weights", {})
    flat = all(p[1] == 1 for points in series.values() for p in points)
    note = " (all 1: the balancer's own weights are not exposed)" if flat and series else ""
    _series_axes(ax, report, series, "Envoy host weight", f"{policy}: weights{note}")


def _plot_policy_inflight(ax: Any, report: Mapping[str, Any], policy: str) -> None:
    """Requests running + waiting on each server, sampled from the simulator every 2 s."""
    series = report["policies"][policy].get("inflight", {})
    _series_axes(ax, report, series, "running + waiting", f"{policy}: in-flight per server")


def _plot_share(ax: Any, report: Mapping[str, Any]) -> None:
    policies = list(report["policies"])
    names = sorted({n for e in report["policies"].values()
                    for n in e["summary"]["per_server"] if n != "None"})
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        per = report["policies"][policy]["summary"]["per_server"]
        total = sum(v["count"] for k, v in per.items() if k != "None") or 1
        ax.bar([j + i * width for j in range(len(names))],
               [per.get(n, {}).get("count", 0) / total for n in names], width, label=policy)
    ax.set_xticks([j + width * (len(policies) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylabel("share of measured requests")
    ax.set_title("requests per server (x-sim-server)")
    ax.legend(fontsize="small")
