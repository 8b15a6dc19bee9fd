r"""Privacy per person on two-tower CIFAR-10: three ways to a person-level (ε, δ), compared.

    python -m experiments.people_benchmark --data_dir=DIR --search_subset=10000

``benchmark_base`` is `clip_cifar10_people` (the 50,000 CIFAR-10 pairs with simulated owners:
15,849 people of 1 to 16 pairs, P[s] ∝ s^−1.5, public seed 0) sampled at q = 0.02 of its unit
for 2 epochs (T = 100, δ = 1e-5), as the per-pair benchmark (`clip_benchmark`) samples pairs;
``search_base`` is the same run on CIFAR-100's training images with its 20 coarse labels and
owners simulated the same way (public with respect to CIFAR-10). The arms (``arms``), at
person-level ε ∈ ``epsilons``, seeds ``seeds``:

* ``group_privacy``: (a) per-pair DP-GCL on the K-capped records at the per-pair target
  (ε/K, δ/(K·e^{(K−1)ε/K})), whose group privacy for a person of ≤ K pairs is (ε, δ);
* ``dp_gcl``: (b) native person-level DP-GCL (groups by person, C = 2B);
* ``logit_dp``: (c) native person-level Logit-DP (C = K·C(∞)).

Each arm starts from the per-pair benchmark's public choice for its mechanism at the same ε
(learning rate, τ, B, DP-GCL's group size: ``per_pair_search``), then searches K ∈ ``k_grid``
and the learning rate × ``learning_rate_grid`` on the public data (`experiments.people_benchmark`).
"""

import ml_collections

from experiments.configs import clip_benchmark
from experiments.configs import clip_cifar10_people


def _people(config):
  config.people.sampling_rate = 0.02  # q over people (native) or K-capped pairs (group privacy)
  config.people.mode = "native"
  return config


def search_base():
  """clip_cifar10_people on the public data (`clip_benchmark.on_public_data`)."""
  return clip_benchmark.on_public_data(_people(clip_cifar10_people.get_config()))


def get_config():
  config = ml_collections.ConfigDict()
  config.search_base = search_base()
  config.benchmark_base = _people(clip_cifar10_people.get_config())
  config.arms = ("group_privacy", "dp_gcl", "logit_dp")
  config.epsilons = (1.0, 8.0)
  config.seeds = (0, 1, 2)
  config.full_train_size = 50_000  # --search_subset scales the search's data from it
  config.checkpoint_every = 10
  config.k_grid = (1, 2, 4, 8)
  config.learning_rate_grid = (0.3, 3.0)  # × the per-pair choice's learning rate
  # The folder (in results_dir) of the per-pair benchmark's public searches, whose choices are
  # each arm's starting point: <mechanism>_eps<ε>/search.json.
  config.per_pair_search = "clip_benchmark_search"
  # The per-pair benchmark's runs (in results_dir): the non-private reference and the per-pair
  # rows of the table (same towers, data and schedule; not person-level guarantees).
  config.per_pair_benchmark = "clip_benchmark"
  return config
