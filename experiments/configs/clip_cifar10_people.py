"""Two-tower CIFAR-10 with simulated owners: privacy per person.

    python -m experiments.clip --config=experiments/configs/clip_cifar10_people.py \\
        --config.data.npz_dir=/path/to/cifar --config.seed=S \\
        --config.target_epsilon=E --workdir=runs/clip_cifar10_people_eE_sS

`clip_cifar10` with every training record given an owner: a heavy-tailed number of pairs per
person, 1 to 16 (P[s] ∝ s^−1.5, `experiments.clip.simulate_owners`, public seed). Every private
method runs natively per person, `make_private(user_ids=, max_pairs_per_user=K)`: people are
Poisson-sampled, each brings at most K of their pairs, ε is per person (DP-GCL grouped by
person, Logit-DP, Naive-DP). ``--config.people.mode=group_privacy`` runs the baseline instead:
per-pair training on the K-capped records at the per-pair target (ε/K, δ/(K·e^{(K−1)ε/K})),
whose group privacy is the person-level (ε, δ). K = 2, 250 people per batch and the learning
rates here are a starting point, NOT chosen on public data. The comparison of the three at
person-level ε = 1 and 8 over 3 seeds, with K and the learning rate chosen on public data and q =
0.02 of each arm's unit (``people.sampling_rate``), is `experiments.people_benchmark`
(experiments/configs/people_benchmark.py; docs/RESULTS.md, "Privacy per person").
"""

import ml_collections

from experiments.configs import clip_cifar10


def get_config():
  config = clip_cifar10.get_config()
  config.people = ml_collections.ConfigDict(
      dict(max_pairs=16, alpha=1.5, seed=0, max_pairs_per_user=2, expected_people_per_batch=250.0))
  return config
