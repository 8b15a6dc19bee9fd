"""Benchmarks of the Logit-DP training step (see docs/BENCHMARKS.md).

    python -m benchmarks.step_benchmark --out results/bench.json
    python -m benchmarks.profile_ghost --sizes 256,1000
"""
