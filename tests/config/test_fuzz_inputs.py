"""Fuzzing the two input parsers: metrics pages and configs.

Invariants: a metrics page either parses or raises MetricsFormatError (a ValueError) — never
anything else, never a NaN in a signal; a config either validates or raises ConfigError with
key paths — never a crash; a config *file* (any bytes: encodings, nesting, anchors, aliases,
alias bombs) loads or raises ConfigError with one line per problem. `FUZZ_EXAMPLES` raises the case count (benchmarks/fuzz.sh).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xds_server.config.load import ConfigError, load_config, parse_config
from xds_server.telemetry.parsers import parse_page
from xds_server.telemetry.parsers.reader import MetricsFormatError

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NAMES = ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
         "vllm:gpu_cache_usage_perc", "vllm:inter_token_latency_seconds_bucket",
         "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
         "vllm:cache_config_info", "sglang:num_queue_reqs", "sglang:token_usage", "tgi_queue_size",
         "nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics",
         "trtllm_kv_cache_utilization", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
         "DCGM_FI_DEV_GPU_UTIL", "x", "vllm:"]
LABELS = ['gpu="0"', 'UUID="GPU-1"', 'le="0.1"', 'le="+Inf"', 'model_name="m"',
          'request_type="waiting"', 'kv_cache_block_type="used"', 'num_gpu_blocks="100"',
          'block_size="16"', 'bad', '"']
VALUES = ["0", "1", "0.5", "-1", "NaN", "+Inf", "-Inf", "1e308", "abc", "", "2.5e-3", "95"]


@st.composite
def metric_line(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(NAMES))
    labels = draw(st.lists(st.sampled_from(LABELS), max_size=3))
    body = "{" + ",".join(labels) + "}" if labels or draw(st.booleans()) else ""
    return f"{name}{body} {draw(st.sampled_from(VALUES))}"


page_lines = st.lists(st.one_of(
    metric_line(),
    st.sampled_from(["# TYPE vllm:inter_token_latency_seconds histogram",
                     "# TYPE DCGM_FI_DEV_FB_USED gauge", "# HELP x y", "# TYPE x counter", ""]),
    st.text(max_size=30)), max_size=25)


@FUZZ
@given(page_lines, st.sampled_from([None, "0", "1"]))
def test_metrics_pages_parse_or_fail_cleanly(lines, gpu):
    try:
        reading = parse_page("\n".join(lines) + "\n", gpu=gpu)
    except (MetricsFormatError, ValueError):
        return
    for name, value in reading.signals().items():
        assert math.isfinite(value), (name, value)
        assert value >= 0, (name, value)
    if reading.kv_usage is not None:
        assert 0 <= reading.kv_usage <= 1


scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.floats(allow_nan=True),
                   st.text(max_size=12), st.sampled_from(["127.0.0.1:8000", "foo", "1.2.3.4:0",
                                                          "[::1]:80", "round_robin", "composite"]))
value = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["name", "model", "address", "endpoints", "lb_policy",
                                     "interval_seconds", "policy", "pool", "versions", "stable",
                                     "canary", "fallback", "rollout", "step_percent", "zzz"]),
                    inner, max_size=4)), max_leaves=12)
config_doc = st.fixed_dictionaries({}, optional={
    "pools": value, "telemetry": value, "weights": value, "xds": value, "listener": value,
    "keda": value, "rollouts": value, "bogus": value})


@FUZZ
@given(config_doc)
def test_configs_validate_or_fail_with_key_paths(doc):
    try:
        parse_config(doc)
    except ConfigError as exc:
        assert exc.problems
        assert all(isinstance(path, str) and reason for path, reason in exc.problems)


# --- config files as bytes: encodings, nesting, anchors and aliases --------------------------

YAML_PIECES = ["pools:", "\n", "- ", "  ", "name: a", "model: m", "endpoints:", "&a ", "&b ",
               "*a", "*b", "[", "]", "{", "}", ", ", ": ", "<<: *a", "!!str ", "!!python/name:x",
               '"\\ud800"', "'", "#", "address: 127.0.0.1:1", "9" * 5000, "1e999", "~", "\t"]
RAW_BYTES = [b"\xff", b"\xfe\xff", b"\xe9", b"\x00", b"\xef\xbb\xbf", b"\xc3\x28", b"\r\n"]
config_bytes = st.lists(st.one_of(st.sampled_from(YAML_PIECES).map(str.encode),
                                  st.sampled_from(RAW_BYTES), st.binary(max_size=8)),
                        max_size=40).map(b"".join)


def _nested(depth: int, alias_levels: int) -> bytes:
    """A deep document, or an alias chain whose expansion is deep or large."""
    if alias_levels:
        rows = ['l0: &l0 ["x", "x", "x", "x"]']
        rows += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 4)}]" for i in range(1, alias_levels)]
        return ("\n".join(rows) + "\n").encode()
    return b"pools: " + b"[" * depth + b"]" * depth + b"\n"


_FUZZ_DIR = tempfile.TemporaryDirectory(prefix="trimtab-fuzz-")


def _load(raw: bytes) -> None:
    path = Path(_FUZZ_DIR.name) / "config.yaml"
    path.write_bytes(raw)
    try:
        load_config(path)
    except ConfigError as exc:
        assert exc.problems
        assert all(isinstance(p, str) and reason and "\n" not in reason
                   for p, reason in exc.problems), exc.problems


@FUZZ
@given(config_bytes)
def test_config_files_load_or_fail_with_one_line_per_problem(raw):
    _load(raw)


@FUZZ
@given(st.integers(0, 3000), st.integers(0, 14))
def test_deep_and_alias_heavy_configs_are_refused_not_crashing(depth, alias_levels):
    _load(_nested(depth, alias_levels))
