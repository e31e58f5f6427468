#!/usr/bin/env bash
# Long fuzz run: N hypothesis cases per target (default 100,000), with the counts printed.
#   benchmarks/fuzz.sh [N]
# Targets: the xDS state machines (SotW and Delta), the metrics-page adapters, the config loader.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-100000}"
mkdir -p benchmarks/results
export FUZZ_EXAMPLES="$N"
for target in \
  "tests/xds/test_protocol_fuzz.py::test_sotw_never_resends_a_nacked_version" \
  "tests/xds/test_protocol_fuzz.py::test_delta_never_resends_a_nacked_version" \
  "tests/config/test_fuzz_inputs.py::test_metrics_pages_parse_or_fail_cleanly" \
  "tests/config/test_fuzz_inputs.py::test_configs_validate_or_fail_with_key_paths"; do
  start=$(date +%s)
  .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 0 --hypothesis-show-statistics "$target" \
    | tee "benchmarks/results/fuzz-$(echo "$target" | sed 's/.*:://').txt" \
    | grep -E "passing|passed|failed" || true
  echo "$target: $N cases requested, $(( $(date +%s) - start )) s"
done
