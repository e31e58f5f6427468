"""Where a bench run's slowest TTFTs come from: per policy, the share of requests and of
the slowest 1 % / 3 % that each server and each prompt-size bucket got.

    python benchmarks/tail_analysis.py benchmarks/results/<run>/seed-S [--top 0.01]

Reads the ``records-<policy>.jsonl`` files ``trimtab bench`` writes (one request a line)
and only prints; it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

BUCKETS = (0, 2_000, 8_192, 16_000, 24_000, 10**9)


def bucket(tokens: int) -> str:
    for low, high in zip(BUCKETS, BUCKETS[1:], strict=False):
        if low <= tokens < high:
            return f"{low // 1000}k-{high // 1000}k" if high < 10**9 else f">={low // 1000}k"
    return "?"


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(name: str, records: list[dict], top: float) -> None:
    done = [r for r in records if r.get("ttft") is not None]
    if not done:
        print(f"{name}: no finished requests")
        return
    done.sort(key=lambda r: r["ttft"], reverse=True)
    k = max(1, round(top * len(done)))
    slow, slow3 = done[:k], done[:max(1, round(3 * top * len(done)))]
    print(f"{name}: {len(done)} finished, {len(records) - len(done)} not; "
          f"P{100 - 100 * top:g} TTFT {slow[-1]['ttft']:.2f} s")
    for label, key in (("server", lambda r: r.get("server") or "?"),
                       ("prompt", lambda r: bucket(r["prompt_tokens"]))):
        every = Counter(key(r) for r in done)
        worst = Counter(key(r) for r in slow)
        worst3 = Counter(key(r) for r in slow3)
        for value in sorted(every):
            ttfts = [r["ttft"] for r in done if key(r) == value]
            print(f"  {label} {value:>9}: {every[value]:5d} req ({100 * every[value] / len(done):4.1f} %)"
                  f"  mean TTFT {statistics.mean(ttfts):6.2f} s  p90 {_q(ttfts, .9):6.2f} s"
                  f"  in top {worst[value]:3d}/{k}  top3x {worst3[value]:3d}/{len(slow3)}")
    pairs = Counter((r.get("server"), bucket(r["prompt_tokens"])) for r in slow3)
    print("  slowest by (server, prompt):", ", ".join(f"{s}/{b}:{n}" for (s, b), n in
                                                     pairs.most_common(8)))


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("run", type=Path)
    p.add_argument("--top", type=float, default=0.01)
    args = p.parse_args()
    for path in sorted(args.run.glob("records-*.jsonl")):
        report(path.stem.removeprefix("records-"), load(path), args.top)


if __name__ == "__main__":
    main()
