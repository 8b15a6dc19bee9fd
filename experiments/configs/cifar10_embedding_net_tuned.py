"""The private CIFAR-10 run with the Logit-DP setting chosen on public CIFAR-100.

`cifar10_embedding_net_triangle` (25,000 records, expected batch 10,000, ε = 5, δ = 1e-5,
triangle clipping; the projected bound's references, if it is chosen, are 64 CIFAR-100 train
images) with the overrides that the finished search of `tune_cifar100` chose,
read from its committed ``docs/results/tune_cifar100/search.json`` and applied once,
unchanged: nothing here is chosen by looking at CIFAR-10. Settings shared by every method
(τ, pair mode, embedding dimension, epochs, learning-rate schedule, clip norm B) apply to
every method of the run; ``learning_rates.logit_dp`` only to Logit-DP. DP-GCL runs beside
Logit-DP, Naive-DP and non-private at its a-priori setting
(`cifar10_embedding_net_dpgcl.add_dp_gcl`), so one run gives every method's point of the
accuracy-vs-ε curve (``--config.target_epsilon=E``; σ is recalibrated). Raises
FileNotFoundError while the search has not been run, ValueError if it has not finished or if
its base is not this config on CIFAR-100 (e.g. a ``--subset`` search).

    python experiments/pretrain.py \
        --config=experiments/configs/cifar10_embedding_net_tuned.py \
        --config.data.npz_dir=DIR --config.seed=S --workdir=runs/cifar10_embnet_tuned_sS

``--config=experiments/configs/cifar10_embedding_net_tuned.py:PATH`` reads another
search.json. `ready` says whether the search has finished, so that a script running several
configs can wait for it rather than start (and fail) too early.
"""

import os

import ml_collections

from experiments import tune
from experiments.configs import cifar10_embedding_net_dpgcl
from experiments.configs import cifar10_embedding_net_projected
from experiments.configs import cifar10_embedding_net_triangle

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEARCH_JSON = os.path.join(_REPO, "docs", "results", "tune_cifar100", "search.json")


def ready(search_json=None) -> bool:
  """Whether the search has finished, so that `get_config` can read its choice."""
  return tune.search_finished(search_json or SEARCH_JSON)


def get_config(search_json=None):
  path = search_json or SEARCH_JSON
  choice = tune.load_choice(path)
  config = cifar10_embedding_net_triangle.get_config()
  # Used if the search chose clip_method="projected": 64 public CIFAR-100 train images.
  config.projection = cifar10_embedding_net_projected.projection_config()
  differ = tune.base_differences(choice["base"], config)
  if differ:
    raise ValueError(f"{path}: the search's base differs from the CIFAR-10 run in {differ}; its "
                     "choice does not transfer unchanged.")
  config = cifar10_embedding_net_dpgcl.add_dp_gcl(tune.apply_overrides(config, choice["overrides"]))
  config.tuned_from = ml_collections.ConfigDict(
      dict(search=os.path.relpath(os.path.abspath(path), _REPO), candidate=choice["name"]))
  return config
