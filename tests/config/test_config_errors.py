"""Config errors an operator can act on: a pool is named by its name, not its place in the
list, and an unknown key comes with the closest known key at that place (issue 25, item 6)."""

from __future__ import annotations

from typing import Any

import pytest

from xds_server.config.load import ConfigError, parse_config


def pool(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": f"m-{name}", "endpoints": [{"address": "127.0.0.1:8001"}],
            **extra}


def problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return caught.value.problems


def test_a_typo_at_the_pool_level_names_the_pool_and_the_key_it_meant():
    data = {"pools": [pool("other"), pool("llama3-8b", lb_polcy="round_robin")]}
    assert problems(data) == [("pools[llama3-8b].lb_polcy",
                               "unknown key; did you mean lb_policy?")]
    assert str(ConfigError(problems(data))) == (
        "pools[llama3-8b].lb_polcy: unknown key; did you mean lb_policy?")


def test_a_typo_at_the_top_level_suggests_the_top_level_key():
    data = {"pools": [pool("p")], "telemtry": {"interval_seconds": 2}}
    assert problems(data) == [("telemtry", "unknown key; did you mean telemetry?")]


@pytest.mark.parametrize(("extra", "path", "meant"), [
    ({"weights": {"polcy": "queueing"}}, "weights.polcy", "policy"),
    ({"weights": {"queueing": {"rate_alfa": 0.5}}}, "weights.queueing.rate_alfa", "rate_alpha"),
    ({"telemetry": {"stale_after_secs": 6}}, "telemetry.stale_after_secs", "stale_after_seconds"),
])
def test_an_unknown_nested_key_gets_the_closest_key_of_its_own_mapping(extra, path, meant):
    assert problems({"pools": [pool("p")], **extra}) == [
        (path, f"unknown key; did you mean {meant}?")]


def test_keys_inside_pools_endpoints_and_versions_are_suggested_from_their_own_schema():
    endpoint = {"address": "127.0.0.1:8001", "metrcs_url": "http://127.0.0.1:8001/metrics"}
    versions = {"stable": {"endpoints": [{"address": "127.0.0.1:8002", "dran": True}]}}
    data = {"pools": [pool("a", endpoints=[endpoint]),
                      {"name": "b", "model": "mb", "versions": versions}]}
    assert sorted(problems(data)) == [
        ("pools[a].endpoints[0].metrcs_url", "unknown key; did you mean metrics_url?"),
        ("pools[b].versions.stable.endpoints[0].dran", "unknown key; did you mean drain?"),
    ]


def test_a_key_like_no_known_one_is_unknown_without_a_guess():
    data = {"pools": [pool("p", zzzqqq=1)], "weights": {"queueing": {"choise_count": 3}}}
    assert sorted(problems(data)) == [("pools[p].zzzqqq", "unknown key"),
                                      ("weights.queueing.choise_count", "unknown key")]


def test_value_errors_and_cross_checks_name_pools_too():
    bad = pool("llama3-8b", endpoints=[{"address": "foo"}])
    assert problems({"pools": [pool("a"), bad]}) == [
        ("pools[llama3-8b].endpoints[0].address", "expected host:port, got 'foo'")]
    falls = pool("primary", fallback="nowhere")
    path, reason = problems({"pools": [falls]})[0]
    assert path == "pools[primary].fallback" and "expected another pool's name" in reason


def test_a_pool_without_a_unique_usable_name_keeps_its_index():
    # duplicate names: the name would not say which; the reason points at the other by index
    dup = problems({"pools": [pool("llama"), {**pool("llama"), "model": "other"}]})
    assert dup == [("pools[1].name", "duplicate pool name 'llama' (also pools[0])")]
    # no name at all, and a name that reads as an index, keep the index
    assert problems({"pools": [pool("p"), {"model": "m2", "endpoints": []}]})[0][0] \
        .startswith("pools[1].")
    assert problems({"pools": [pool("7", lb_polcy="x"), pool("q")]}) == [
        ("pools[0].lb_polcy", "unknown key; did you mean lb_policy?")]
