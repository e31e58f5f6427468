"""Where things are, for tests at any depth under tests/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
EXAMPLES = ROOT / "examples"
METRICS_FIXTURES = ROOT / "tests" / "fixtures" / "metrics"
