"""benchmarks/merge_bench.py refuses runs that are not the same comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.merge_bench import main, merge_one


def _run(path: Path, policy: str, **config: object) -> Path:
    path.mkdir(parents=True)
    base = {"fleet": "f.yaml", "workload": "w.yaml", "rate": 9.2, "duration": 120.0,
            "warmup": 12.0, "seed": 42, "tail": 60.0}
    doc = {"config": {**base, **config}, "policies": {policy: {"summary": {}}}}
    (path / "bench.json").write_text(json.dumps(doc))
    (path / f"records-{policy}.jsonl").write_text("")
    return path


def test_runs_that_differ_in_more_than_their_policies_are_refused(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", "least_request")
    b = _run(tmp_path / "b", "trimtab", rate=10.0)
    with pytest.raises(ValueError, match="rate"):
        merge_one(tmp_path / "out", [a, b])
    c = _run(tmp_path / "c", "least_request")
    with pytest.raises(ValueError, match="two of the runs"):
        merge_one(tmp_path / "out2", [a, c])


def test_the_merged_run_holds_every_policy_and_its_records(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", "least_request")
    b = _run(tmp_path / "b", "trimtab")
    merge_one(tmp_path / "out", [a, b])
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert sorted(doc["policies"]) == ["least_request", "trimtab"]
    assert doc["config"]["merged_from"] == [str(a), str(b)]
    assert (tmp_path / "out" / "records-trimtab.jsonl").exists()


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 2
    assert main([str(tmp_path / "o"), str(tmp_path / "none"), str(tmp_path / "none2")]) == 2
