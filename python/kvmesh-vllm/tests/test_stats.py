"""kvmesh counters into vLLM's connector stats: parsing, deltas, aggregation (no servers)."""

from __future__ import annotations

from kvmesh_vllm.stats import CounterDeltas, KvmeshStats, counter_samples

TEXT = """# HELP kvmesh_p2p_pulls Pulls by outcome.
# TYPE kvmesh_p2p_pulls counter
kvmesh_p2p_pulls_total{outcome="complete",reason="none"} 3
kvmesh_p2p_pulls_total{outcome="failed",reason="fingerprint_mismatch"} 1
kvmesh_p2p_blocks_total{direction="in"} 24
kvmesh_p2p_pull_duration_seconds_sum 0.5
kvmesh_p2p_fetches_served_total 2
kvmesh_cpu_tier_blocks 7
# EOF
"""


def test_counter_samples_keep_only_the_exported_counters():
    assert counter_samples(TEXT) == {
        "kvmesh_p2p_pulls|complete|none": 3.0,
        "kvmesh_p2p_pulls|failed|fingerprint_mismatch": 1.0,
        "kvmesh_p2p_blocks|in": 24.0,
        "kvmesh_p2p_fetches_served": 2.0,
    }


def test_deltas_report_only_growth_since_the_last_step():
    d = CounterDeltas()
    assert d.take(TEXT)["kvmesh_p2p_blocks|in"] == 24.0
    assert d.take(TEXT) == {}
    grown = d.take(TEXT.replace('{direction="in"} 24', '{direction="in"} 32'))
    assert grown == {"kvmesh_p2p_blocks|in": 8.0}


def test_stats_of_two_processes_add_up():
    scheduler = KvmeshStats(data={"counters": {"kvmesh_p2p_pulls|failed|miss": 1.0}})
    worker = KvmeshStats(data={"counters": {"kvmesh_p2p_pulls|failed|miss": 2.0,
                                            "kvmesh_p2p_blocks|in": 8.0}})
    total = worker.aggregate(scheduler)
    assert total.data["counters"] == {"kvmesh_p2p_pulls|failed|miss": 3.0,
                                      "kvmesh_p2p_blocks|in": 8.0}
    assert not total.is_empty()
    assert total.reduce()["kvmesh_p2p_blocks:in"] == 8.0
    total.reset()
    assert total.is_empty()
    assert KvmeshStats().is_empty()
