"""Benchmark: tail latency with and without request tiers (issue 16): `trimtab bench tiers`.

    .venv/bin/python benchmarks/tiers.py [--duration 15] [--rate 8] [--seeds 1,2]

The scenario lives in ``trimtab_dev/bench/tiers.py``; this script runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trimtab_dev.bench.tiers import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
