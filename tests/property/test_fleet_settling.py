"""Soak property of the `gpus` annotation's hysteresis, seconds long (the unit suite stays
a quick loop): 72,000 noisy GPU readings through the real simulator and labeler."""

from gpudaemon.agent.cache import Cache
from gpudaemon.backends.simulated import SimulatedBackend, parse_profile
from gpudaemon.labels import NodeLabeler

P = "gpudaemon.io/"


def test_a_fleet_of_noisy_steady_gpus_settles_without_rewrites() -> None:
    """1,600 GPUs (25 nodes x 64) with noisy steady load: after the settling re-base,
    the annotation of no node changes in 40 reconciles (20 minutes at the default schedule)."""
    profile = parse_profile(
        "gpus: [{name: NVIDIA H100 80GB HBM3, memory_total_mib: 81559, compute_capability: '9.0',"
        " count: 64, utilization: {pattern: steady, mean: 0.55, noise: 0.05}}]"
    )
    changes = 0
    for seed in range(25):
        b, cache, labeler = SimulatedBackend(profile, seed=seed), Cache(), NodeLabeler()
        cache.put_inventory(b.inventory())
        cache.put_samples(b.sample())
        for _ in range(labeler.annotator.q.warmup_readings - 1):
            cache.put_samples(b.sample())
            labeler.build(cache.get())
        first = labeler.build(cache.get()).annotations[P + "gpus"]
        for _ in range(40):
            cache.put_samples(b.sample())
            now = labeler.build(cache.get()).annotations[P + "gpus"]
            changes += now != first
            first = now
    assert changes == 0
