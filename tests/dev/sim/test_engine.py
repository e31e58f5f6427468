"""Engine behaviour in virtual time (no sockets, no sleeping)."""

from __future__ import annotations

import random

import pytest

from trimtab_dev.sim.engine import (
    Engine,
    ManualClock,
    SimRequest,
    estimate_capacity,
    run_virtual,
)
from trimtab_dev.sim.profiles import (
    A100_40G,
    GPUS,
    H100_80G,
    L4_24G,
    LLAMA_3_1_8B,
    GpuProfile,
    kv_capacity_tokens,
)


def make(gpu: GpuProfile = A100_40G, **kw: object) -> tuple[Engine, ManualClock]:
    clock = ManualClock()
    return Engine(gpu, LLAMA_3_1_8B, clock=clock, **kw), clock  # type: ignore[arg-type]


def step_all(engine: Engine, clock: ManualClock, check=None) -> None:
    """Run until idle, calling ``check(engine)`` after every plan."""
    while engine.has_work():
        plan = engine.plan_step()
        assert plan is not None
        if check is not None:
            check(engine)
        clock.set(plan.start + plan.duration)
        engine.finish_step(plan)


def mean_itl(req: SimRequest) -> float:
    assert req.first_token_at is not None and req.finished_at is not None
    return (req.finished_at - req.first_token_at) / (req.generated - 1)


def test_kv_capacity_follows_memory_budget() -> None:
    caps = {name: kv_capacity_tokens(g, LLAMA_3_1_8B) for name, g in GPUS.items()}
    # 0.9 x 22.5 GiB - 14.99 GiB weights - 0.6 GiB leaves ~4.6 GiB = ~38k tokens on an L4.
    assert 35_000 < caps["L4-24G"] < 41_000
    assert caps["H100-80G"] > caps["A100-40G"] > caps["L4-24G"]
    assert all(c % 16 == 0 for c in caps.values())


def test_single_stream_matches_published_decode_speed() -> None:
    # The calibration points in profiles.Efficiency: 13.3 ms/token on A100-40GB and
    # 6.48 ms/token on H100 at concurrency 1.
    for gpu, measured in ((A100_40G, 0.0133), (H100_80G, 0.00648)):
        engine, clock = make(gpu)
        req = SimRequest("a", 1024, 128)
        run_virtual(engine, clock, [(0.0, req)])
        assert mean_itl(req) == pytest.approx(measured, rel=0.05)


def test_requests_that_do_not_fit_wait_in_the_queue() -> None:
    engine, clock = make(L4_24G)
    reqs = [SimRequest(str(i), 12_000, 200) for i in range(5)]
    for r in reqs:
        engine.submit(r, now=0.0)
    holders: list[int] = []

    def check(e: Engine) -> None:
        assert 0 <= e.free_blocks <= e.total_blocks
        # requests holding a whole prompt's KV (a newcomer may hold a first chunk)
        holders.append(sum(1 for r in reqs if r.blocks * 16 >= r.prompt_tokens))

    step_all(engine, clock, check)
    fit = engine.kv_capacity_tokens // 12_200
    assert max(holders) <= fit < len(reqs)
    first_done = min(r.finished_at for r in reqs if r.finished_at is not None)
    assert reqs[-1].scheduled_at is not None and reqs[-1].scheduled_at >= first_done
    assert all(r.generated == 200 and not r.aborted for r in reqs)
    assert engine.free_blocks == engine.total_blocks


def test_ttft_grows_with_queue_position() -> None:
    engine, clock = make(A100_40G)
    reqs = [SimRequest(str(i), 1500, 32) for i in range(64)]
    run_virtual(engine, clock, [(0.0, r) for r in reqs])
    ttfts = [r.first_token_at - r.arrival for r in reqs]  # type: ignore[operator]
    assert ttfts == sorted(ttfts)
    assert ttfts[-1] > 10 * ttfts[0]
    assert engine.stats.ttft.count == 64


def test_itl_grows_with_batch_size() -> None:
    itls = []
    for batch in (1, 16, 128):
        engine, clock = make(A100_40G)
        reqs = [SimRequest(str(i), 500, 200) for i in range(batch)]
        run_virtual(engine, clock, [(0.0, r) for r in reqs])
        itls.append(sum(mean_itl(r) for r in reqs) / batch)
    assert itls[0] < itls[1] < itls[2]
    assert itls[2] > 1.5 * itls[0]


def test_step_time_is_bandwidth_bound_for_decode_and_compute_bound_for_prefill() -> None:
    engine, _ = make(H100_80G)
    decode = SimRequest("d", 100, 10, computed=100)
    prefill = SimRequest("p", 4096, 10)
    one_token = engine.step_time([(decode, 1)])
    big_prefill = engine.step_time([(prefill, 4096)])
    weights_only = LLAMA_3_1_8B.weight_bytes / (H100_80G.mem_bandwidth * engine.eff.mbu)
    assert one_token == pytest.approx(weights_only + engine.eff.step_overhead_s, rel=0.01)
    assert big_prefill > 5 * one_token


def test_kv_exhaustion_preempts_but_never_fails() -> None:
    engine, clock = make(L4_24G)
    reqs = [SimRequest(str(i), 3000, 2000) for i in range(12)]  # 60k tokens at the end
    run_virtual(engine, clock, [(0.01 * i, r) for i, r in enumerate(reqs)])
    assert engine.stats.preemptions > 0
    assert any(r.preemptions > 0 for r in reqs)
    assert all(r.generated == 2000 and r.finished_at is not None for r in reqs)
    assert engine.stats.success == len(reqs)
    assert engine.free_blocks == engine.total_blocks and not engine.has_work()


def test_preempted_request_is_the_newest() -> None:
    engine, clock = make(L4_24G)
    reqs = [SimRequest(str(i), 3000, 2000) for i in range(12)]
    run_virtual(engine, clock, [(0.01 * i, r) for i, r in enumerate(reqs)])
    victims = [int(r.rid) for r in reqs if r.preemptions]
    assert 0 not in victims  # the oldest request is never the victim


def test_abort_frees_kv_and_forgets_request() -> None:
    engine, clock = make(A100_40G)
    a, b = SimRequest("a", 4000, 100), SimRequest("b", 4000, 100)
    engine.submit(a, now=0.0)
    engine.submit(b, now=0.0)
    plan = engine.plan_step()
    assert plan is not None and a.blocks > 0
    engine.abort(a)
    engine.abort(b)
    clock.set(plan.start + plan.duration)
    result = engine.finish_step(plan)
    assert result.emitted == [] and not engine.has_work()
    assert engine.free_blocks == engine.total_blocks


def test_validate_rejects_what_vllm_rejects() -> None:
    engine, _ = make(L4_24G, max_model_len=32_768)
    assert engine.validate(32_000, 512) is None
    assert "maximum context length" in (engine.validate(32_500, 512) or "")
    assert engine.validate(0, 10) is not None
    with pytest.raises(ValueError):
        make(L4_24G, max_model_len=100_000)


def test_slow_factor_scales_step_time() -> None:
    fast, _ = make(A100_40G)
    slow, _ = make(A100_40G, slow=3.0)
    batch = [(SimRequest("x", 1000, 10), 1000)]
    assert slow.step_time(batch) == pytest.approx(3 * fast.step_time(batch))


def test_virtual_run_is_deterministic() -> None:
    def run() -> list[tuple[float | None, float | None]]:
        engine, clock = make(L4_24G)
        rng = random.Random(7)
        reqs = [SimRequest(str(i), rng.randint(100, 6000), rng.randint(10, 300))
                for i in range(40)]
        run_virtual(engine, clock, [(0.05 * i, r) for i, r in enumerate(reqs)])
        return [(r.first_token_at, r.finished_at) for r in reqs]

    assert run() == run()


def test_capacity_ordering_across_profiles() -> None:
    rng = random.Random(3)
    samples = [(rng.randint(200, 2000), rng.randint(64, 256)) for _ in range(300)]
    caps = [estimate_capacity(g, LLAMA_3_1_8B, samples).req_per_s
            for g in (H100_80G, A100_40G, L4_24G)]
    assert caps[0] > caps[1] > caps[2] > 0
