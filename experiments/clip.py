r"""CLIP-style two-tower training, private and not: CIFAR images and their class-name texts.

    python -m experiments.clip --config=experiments/configs/clip_cifar100.py \
        --config.data.npz_dir=/path/to/cifar --workdir=runs/clip
    python -m experiments.clip --config=experiments/configs/clip_tiny.py     # synthetic, seconds

The class names ship in experiments/label_names/ (CIFAR-10 and CIFAR-100);
--config.data.label_names=FILE.json reads others.

An image tower (the paper's embedding net) and a text tower (bag of words: token
embeddings, masked mean, two dense layers) map into one d-dimensional space; one
params pytree holds both and they share no parameter, so `logit_dp.clipped_grad(...,
positive_embed_fn=text_tower)` clips exact pair-gradient norms at the cost of "triangle".
Each record is one (image, text) pair: the image and the text "a photo of a <fine label
name>", tokenised with a word vocabulary built here from the class names (nothing is
downloaded). The metric is zero-shot accuracy on the test images: an image is assigned
the class whose name text embeds closest to it (cosine), the same protocol as CLIP.

Privacy per person (``config.people.max_pairs_per_user`` = K > 0): the records get simulated
owners (`simulate_owners`: a heavy-tailed number of pairs per person, 1 to
``config.people.max_pairs``), and every private method runs with
``make_private(user_ids=, max_pairs_per_user=K)``, ``config.people.expected_people_per_batch``
people per batch, ε per person (the table says which unit). With ``config.people.mode =
"group_privacy"`` the comparison's baseline runs instead: per-pair training on the K-capped
records (`capped_records`) at the per-pair target whose group privacy is the person-level
(ε, δ) (`group_privacy_target`), its guarantee converted by group privacy. With
``config.people.sampling_rate`` = q set, the batch is q over the run's unit instead, in both
modes: q·(number of people) people natively, q·(number of K-capped records) pairs in the
baseline (the same q and T in every mode and at every K).

Fine-tuning (optional fields, read with their defaults when absent): ``config.init_from``, the
folder of an orbax checkpoint of both towers' params (`save_params` of an earlier run, e.g.
non-private pretraining on public data), initialises the towers; ``config.trainable`` "all"
(default) trains every parameter, "heads" the projection heads only (the last dense layer of
each tower, `is_head`), through ``make_private(trainable=)`` (the non-private reference masks its
gradient the same way); ``config.vocabulary_from``, data-set names ("cifar100", or
"cifar100:coarse" for another label set), adds their class names to the vocabulary, so that
towers pretrained on one data set keep their token embeddings on another; ``config.save_params``
saves every method's final params in ``workdir/params/<method>``.

Methods (``config.methods``): the private mechanisms "logit_dp" (per-pair clipping,
``config.clip_method``), "dp_gcl" (hash groups of ``config.dp_gcl.group_size`` expected records,
each group's gradient clipped) and "naive_dp" (the whole batch's gradient clipped), each set up
by `logit_dp.make_private` with two towers (Poisson sampling, noise σ·C with σ from
`logit_dp.accounting` for (target ε, δ) after the configured steps, C the mechanism's own
sensitivity), and "non_private" (shuffled epochs, plain gradient of the same loss). Each method
has its own learning rate (``config.learning_rates.<method>``). Output in ``workdir``:
config.json (no machine paths), results.json, results.md; the secret noise and sampling seeds of
the private runs in ``<workdir>.secrets/`` (kept apart); with ``config.checkpoint_every`` > 0, the
private runs' checkpoints in ``workdir/checkpoints/<method>`` (they hold the noise key: keep them
private), from which a re-run resumes; a method already in results.json is not trained again.

Duplicated texts. With class-name texts a batch of n pairs holds only ≤ 100 distinct
texts: two records of one class have the same x', so v̂_j = v̂_i and Z_ij = Z_ii. The
row-wise InfoNCE loss then counts that same-class text as a negative: its gradient
cancels part of the positive's, and row i's loss cannot drop below ln(k_i) for k_i
copies of its text (a fixed offset, no wrong signal between classes). The privacy unit
is unchanged: a record is one (image, text) pair, and the sensitivity bound
(docs/METHOD.md) holds for any Z, equal columns included; the text of a record reveals
its label, which the guarantee therefore covers too (the list of class names is public).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any

if __package__ in (None, ""):  # `python experiments/clip.py`: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import logit_dp
from experiments import compilation_cache
from experiments import data as data_lib
from experiments import train as train_lib
from experiments import workdirs
from logit_dp import models

METHOD_LABELS = {
    "logit_dp": "Logit-DP (two towers)", "dp_gcl": "DP-GCL (two towers)",
    "naive_dp": "Naive-DP (two towers)", "non_private": "Non-private"
}
#: The mechanism of each private method: its `make_private` method name comes from the config.
PRIVATE_METHODS = ("logit_dp", "dp_gcl", "naive_dp")
METHODS = PRIVATE_METHODS + ("non_private",)
# Settings that change how a run is logged or evaluated in batches, not what it trains.
_RUN_ONLY_FIELDS = ("log_every", "eval_batch_size", "checkpoint_every", "secrets_dir",
                    "on_nonfinite_rows", "methods")
PADDING = "<pad>"

#: The class names shipped with the repository: label_names/<data.name>.json.
LABEL_NAMES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "label_names")


def label_names_path(path: str | None, name: str) -> str:
  """``path``, or the shipped file of data set ``name`` (label_names/<name>.json) if None."""
  if path:
    return os.path.expanduser(path)
  shipped = os.path.join(LABEL_NAMES_DIR, f"{name}.json")
  if not os.path.exists(shipped):
    raise ValueError(f"No class names ship for data set {name!r} ({LABEL_NAMES_DIR} has "
                     f"{sorted(os.listdir(LABEL_NAMES_DIR))}): set config.data.label_names to "
                     "the path of a class-names JSON file.")
  return shipped


def load_label_names(path: str | None, label: str = "fine", name: str = "cifar100") -> list[str]:
  """Class names from a JSON file: {"<label>_label_names": [...]}, {"label_names": [...]} or a
  list; ``path`` None reads the file shipped for data set ``name`` (`label_names_path`)."""
  path = label_names_path(path, name)
  with open(path) as f:
    names = json.load(f)
  if isinstance(names, dict):
    key = next((k for k in (f"{label}_label_names", "label_names") if k in names), None)
    if key is None:
      raise ValueError(f"{path} has no {label + '_label_names'!r} (keys: {sorted(names)}).")
    names = names[key]
  if not names or not all(isinstance(n, str) and n for n in names):
    raise ValueError(f"{path}: expected a non-empty list of class names.")
  return list(names)


def class_texts(names: list[str], template: str) -> list[str]:
  """template.format(name) per class, underscores as spaces ("maple_tree" -> "maple tree")."""
  return [template.format(name.replace("_", " ")) for name in names]


def words(text: str) -> list[str]:
  return re.findall(r"[a-z0-9]+", text.lower())


class Vocabulary:
  """A word vocabulary built from the texts themselves; id 0 is padding."""
  def __init__(self, texts: list[str]):
    self.words = [PADDING] + sorted({w for t in texts for w in words(t)})
    self.index = {w: i for i, w in enumerate(self.words)}

  def __len__(self) -> int:
    return len(self.words)

  def tokenize(self, texts: list[str], length: int | None = None) -> dict[str, np.ndarray]:
    """{"ids": (K, L) int32, "mask": (K, L) bool}, padded to the longest text (or `length`)."""
    tokens = [[self.index[w] for w in words(t)] for t in texts]
    length = length or max(len(t) for t in tokens)
    if any(len(t) > length for t in tokens):
      raise ValueError(f"a text has more than {length} words.")
    ids = np.zeros((len(texts), length), np.int32)
    for k, t in enumerate(tokens):
      ids[k, :len(t)] = t
    return {"ids": ids, "mask": ids != 0}


class TextTower(nn.Module):
  """Bag of words: token embeddings, their masked mean, a tanh layer, a dense projection."""
  vocab_size: int
  width: int = 32
  embedding_dim: int = 16

  @nn.compact
  def __call__(self, tokens):
    e = nn.Embed(self.vocab_size, self.width)(tokens["ids"])
    m = tokens["mask"][..., None].astype(e.dtype)
    mean = jnp.sum(e * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    return nn.Dense(self.embedding_dim)(nn.tanh(nn.Dense(self.width)(mean)))


def load_images(config) -> dict[str, Any]:
  """x_train, y_train, x_test, y_test (uint8 NHWC images, int labels), subsets applied."""
  rng = np.random.default_rng(config.seed)
  names = load_label_names(config.data.label_names, config.data.label, config.data.name)
  if config.data.source == "synthetic":  # tests: class-coloured noise, learnable
    k, size = len(names), config.data.image_size
    colours = rng.uniform(0, 255, (k, 1, 1, 3))

    def split(count):
      y = rng.integers(0, k, count).astype(np.int32)
      x = np.clip(colours[y] + rng.normal(0, 20, (count, size, size, 3)), 0, 255)
      return x.astype(np.uint8), y

    (x_tr, y_tr), (x_te, y_te) = split(config.data.train_subset), split(config.data.test_subset)
    ds = dict(x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
  elif config.data.source == "npz":
    ds = data_lib.load_npz(config.data.npz_dir, config.data.name, config.data.label)
  else:
    raise ValueError(f"data.source must be 'npz' or 'synthetic', got {config.data.source!r}.")
  if int(max(ds["y_train"].max(), ds["y_test"].max())) >= len(names):
    raise ValueError(f"{len(names)} class names but labels up to {ds['y_train'].max()}.")
  for split in ("train", "test"):
    x, y = data_lib._subset(ds[f"x_{split}"], ds[f"y_{split}"], config.data.get(f"{split}_subset"),
                            rng)
    ds[f"x_{split}"], ds[f"y_{split}"] = x, y
  ds["names"] = names
  return ds


def vocabulary_texts(config) -> list[str]:
  """The class-name texts of ``config.vocabulary_from`` (entries "name" or "name:label", the
  names shipped in label_names/): words the vocabulary holds beside the data's own."""
  texts = []
  for entry in config.get("vocabulary_from") or ():
    name, _, label = str(entry).partition(":")
    texts += class_texts(load_label_names(None, label or "fine", name), config.text_template)
  return texts


#: The towers' projection heads, the last dense layer of each: ``config.trainable = "heads"``.
HEADS = (("image", "Dense_0"), ("text", "Dense_1"))


def is_head(path, leaf) -> bool:
  """The ``trainable=`` predicate of ``config.trainable = "heads"``: the leaves of `HEADS`."""
  del leaf
  return tuple(getattr(k, "key", None) for k in path[:2]) in HEADS


def trainable_of(config):
  """make_private's ``trainable=`` of ``config.trainable``: None ("all", the default) or
  `is_head` ("heads")."""
  mode = config.get("trainable") or "all"
  if mode == "all":
    return None
  if mode == "heads":
    return is_head
  raise ValueError(f"config.trainable must be 'all' or 'heads', got {mode!r}.")


def load_params(path: str, template):
  """The towers' params saved by ``config.save_params`` in ``path`` (an orbax checkpoint),
  restored onto the structure and dtypes of ``template``."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"config.init_from: {path} is not a saved params folder (a run with "
                            "config.save_params = True writes workdir/params/<method>).")
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, template)


def save_params(path: str, params) -> None:
  """Saves the towers' params in ``path`` (an orbax checkpoint; replaces an earlier one)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(path), params, force=True)


def make_towers(config, vocab_size: int, image_shape, tokens_one):
  """(embed_fn, positive_embed_fn, params): image tower on x, text tower on x'."""
  image = models.EmbeddingNet(embedding_dim=config.model.embedding_dim,
                              channels=tuple(config.model.channels))
  text = TextTower(vocab_size, config.model.text_width, config.model.embedding_dim)
  k_image, k_text = jax.random.split(jax.random.PRNGKey(config.seed))
  params = {
      "image": image.init(k_image, jnp.zeros((1,) + tuple(image_shape), jnp.float32))["params"],
      "text": text.init(k_text, tokens_one)["params"],
  }

  def embed_images(p, x):
    return image.apply({"params": p["image"]}, data_lib.to_float(x))

  def embed_texts(p, tokens):
    return text.apply({"params": p["text"]}, tokens)

  return embed_images, embed_texts, params


def zero_shot(embed_images, embed_texts, params, images, labels, class_tokens,
              batch_size: int) -> dict[str, float]:
  """Top-1 / top-5 accuracy of argmax_c cos(image, text_c) over the class-name texts."""
  texts = logit_dp.losses.normalize(embed_texts(params, class_tokens))
  embed = jax.jit(lambda p, x: jnp.matmul(logit_dp.losses.normalize(embed_images(p, x)), texts.T))
  scores = np.concatenate([
      np.asarray(embed(params, images[i:i + batch_size]))
      for i in range(0, len(labels), batch_size)
  ])
  top5 = np.argsort(-scores, axis=1)[:, :5]
  return dict(zero_shot_top1=float(np.mean(top5[:, 0] == labels)),
              zero_shot_top5=float(np.mean(np.any(top5 == labels[:, None], axis=1))))


def _pairs(ds, tokens, indices):
  """(images, texts) of the records `indices` (record r = training image r and its text)."""
  return ds["x_train"][indices], jax.tree_util.tree_map(lambda a: a[ds["y_train"][indices]], tokens)


def simulate_owners(num_records: int, max_pairs: int = 16, alpha: float = 1.5,
                    seed: int = 0) -> np.ndarray:
  """Simulated owners of the records: (N,) person ids, a heavy-tailed number of pairs each.

  Person sizes are drawn i.i.d. from {1, …, max_pairs} with P[s] ∝ s^−alpha until every record
  has an owner (the last person takes the records left); the records are dealt to the people in
  a random order. Everything comes from ``seed`` (public: the owners are part of the simulated
  data, not of the mechanism).
  """
  if num_records < 1 or max_pairs < 1:
    raise ValueError(f"num_records and max_pairs must be ≥ 1, got {num_records}, {max_pairs}.")
  rng = np.random.default_rng(seed)
  sizes_all = np.arange(1, max_pairs + 1)
  weights = sizes_all.astype(np.float64) ** -float(alpha)
  sizes = []
  while sum(sizes) < num_records:
    sizes.append(int(rng.choice(sizes_all, p=weights / weights.sum())))
  sizes[-1] -= sum(sizes) - num_records
  owners = np.repeat(np.arange(len(sizes)), sizes)
  return owners[rng.permutation(num_records)]


def group_privacy_target(epsilon: float, delta: float, k: int) -> tuple[float, float]:
  """The per-pair (ε′, δ′) = (ε/k, δ/(k·e^{(k−1)ε′})) whose group privacy for k pairs,
  (kε′, k·e^{(k−1)ε′}·δ′), is (ε, δ): the per-pair target of a person-level (ε, δ) when every
  person has at most k pairs."""
  eps = float(epsilon) / k
  return eps, float(delta) / (k * np.exp((k - 1) * eps))


def group_privacy(epsilon: float, delta: float, k: int) -> tuple[float, float]:
  """(kε, k·e^{(k−1)ε}·δ): a per-pair (ε, δ) guarantee for a group of k pairs."""
  return k * float(epsilon), min(1.0, k * float(np.exp((k - 1) * float(epsilon))) * float(delta))


def capped_records(owners: np.ndarray, k: int, seed: int) -> np.ndarray:
  """Sorted indices of at most k records per owner, chosen at random (public seed): the K-capped
  dataset of per-pair training converted by group privacy."""
  rng = np.random.default_rng([seed, k])
  order = rng.permutation(len(owners))
  ranks = np.empty(len(owners), np.int64)
  seen: dict[int, int] = {}
  for r in order:
    ranks[r] = seen.get(int(owners[r]), 0)
    seen[int(owners[r])] = ranks[r] + 1
  return np.flatnonzero(ranks < k)


def _people_mode(config) -> str | None:
  people = config.get("people")
  if people is None or not people.get("max_pairs_per_user"):
    return None
  mode = people.get("mode", "native")
  if mode not in ("native", "group_privacy"):
    raise ValueError(f"config.people.mode must be 'native' or 'group_privacy', got {mode!r}.")
  return mode


def _sampling_rate(people) -> float | None:
  """config.people.sampling_rate: None, or a rate in (0, 1]."""
  rate = people.get("sampling_rate")
  if rate is None:
    return None
  if not 0.0 < float(rate) <= 1.0:
    raise ValueError(f"config.people.sampling_rate must be in (0, 1], got {rate!r}.")
  return float(rate)


def person_kwargs(config, num_records: int) -> dict:
  """make_private's keywords of privacy per person (config.people.max_pairs_per_user = K > 0,
  mode "native"): simulated owners (`simulate_owners`), K and the expected people per batch
  (``people.expected_people_per_batch``, or q·M with q = ``people.sampling_rate`` when set, M
  the number of people); {} per pair and in mode "group_privacy" (per-pair training on the
  K-capped records)."""
  people = config.get("people")
  if _people_mode(config) != "native":
    return {}
  owners = simulate_owners(num_records, int(people.max_pairs), float(people.alpha),
                           int(people.seed))
  rate = _sampling_rate(people)
  expected = (float(people.expected_people_per_batch) if rate is None else rate
              * len(np.unique(owners)))
  return dict(user_ids=owners, max_pairs_per_user=int(people.max_pairs_per_user),
              expected_batch_size=expected)


def make_private_method(config, method: str) -> dict:
  """The `make_private` keywords of a private method: its method name, DP-GCL's group size and
  the ``trainable=`` of ``config.trainable``."""
  fine_tuning = {} if trainable_of(config) is None else dict(trainable=trainable_of(config))
  if method == "logit_dp":
    return dict(method=config.clip_method, **fine_tuning)
  if method == "dp_gcl":
    return dict(method="dp_gcl", group_size=config.dp_gcl.group_size, **fine_tuning)
  if method == "naive_dp":
    return dict(method="naive", **fine_tuning)
  raise ValueError(f"{method!r} is not a private method: use one of {PRIVATE_METHODS}.")


def train_private(config, ds, tokens, towers, workdir: str, log,
                  method: str = "logit_dp") -> dict[str, Any]:
  """A private mechanism with two towers, set up by `logit_dp.make_private`; resumes from
  workdir/checkpoints/<method> when config.checkpoint_every > 0."""
  embed_images, embed_texts, params = towers
  noise_seed, sampling_seed = train_lib.privacy_seeds(config, workdir, method)
  loss = logit_dp.losses.contrastive(config.temperature)
  target = (config.target_epsilon, config.target_delta)
  mode = _people_mode(config)
  if mode == "group_privacy":  # per pair on the K-capped records, (ε, δ) per person by groups
    people = config.people
    k = int(people.max_pairs_per_user)
    owners = simulate_owners(len(ds["y_train"]), int(people.max_pairs), float(people.alpha),
                             int(people.seed))
    keep = capped_records(owners, k, int(people.seed))
    ds = dict(ds, x_train=ds["x_train"][keep], y_train=ds["y_train"][keep])
    target = group_privacy_target(*target, k)
  num_records = len(ds["y_train"])
  batch_size = config.batch_size
  if mode == "group_privacy" and _sampling_rate(config.people) is not None:
    batch_size = _sampling_rate(config.people) * num_records  # q over the K-capped records
  # Per person (config.people): simulated owners, K pairs each at most, E[people] per batch.
  per_person = {"expected_batch_size": batch_size, **person_kwargs(config, num_records)}
  private = logit_dp.make_private(embed_images, loss, config.clip_norm, target_epsilon=target[0],
                                  target_delta=target[1], num_records=num_records,
                                  epochs=config.num_epochs,
                                  optimizer=optax.adam(config.learning_rates[method]), mean=True,
                                  microbatch_size=config.microbatch_size,
                                  noise_key=jax.random.key(noise_seed), sampler_seed=sampling_seed,
                                  positive_embed_fn=embed_texts, **per_person,
                                  **make_private_method(config, method))
  grouped = method == "dp_gcl"
  # Diagnostic on the initial parameters and 64 TEST pairs (never on training records, which
  # would release something not covered by the guarantee): the share of norms above B.
  test_texts = jax.tree_util.tree_map(lambda a: a[ds["y_test"][:64]], tokens)
  test_pairs = (ds["x_test"][:64], test_texts)
  if grouped:
    _, _, stats = private.grad_fn.with_stats(params, *test_pairs,
                                             record_ids=np.arange(len(test_pairs[0])),
                                             group_key=jax.random.key(0))
    clipped_at_start = float(stats.fraction_clipped)
  elif method == "naive_dp":
    clipped_at_start = float(private.grad_fn.with_stats(params, *test_pairs)[2].fraction_clipped)
  else:
    initial_norms = logit_dp.clip_methods.pair_grad_norms(embed_images, params, *test_pairs,
                                                          positive_embed_fn=embed_texts,
                                                          trainable=trainable_of(config))
    clipped_at_start = float(np.mean(np.asarray(initial_norms) > config.clip_norm))
  opt_state = private.optimizer.init(params)
  every = int(config.get("checkpoint_every") or 0)
  ckpt_dir = os.path.abspath(os.path.join(workdir, "checkpoints", method))
  if every:
    (params, opt_state), private = private.restore_checkpoint(ckpt_dir, (params, opt_state),
                                                              missing_ok=True)
  train_step = private.make_train_step(on_nonfinite=config.get("on_nonfinite_rows", "warn"))
  start = time.time()
  first = private.ledger.steps
  log(f"{method}: steps {first + 1}..{private.steps}; compiling the first one")
  # Record r: training image r and the text of its class (a public caption).
  records = (ds["x_train"], jax.tree_util.tree_map(lambda a: a[ds["y_train"]], tokens))
  # A resumed run that already finished has no step left (batches() would raise).
  for batch in private.batches() if first < private.steps else ():
    params, opt_state, _ = train_step(params, opt_state, batch, records)
    step = private.ledger.steps
    if every and (step % every == 0 or step == private.steps):
      private.save_checkpoint(ckpt_dir, (params, opt_state), max_to_keep=1)
    if step % config.log_every == 0 or step == private.steps:
      log(f"{method} step {step}/{private.steps}  ε = {private.ledger.epsilon():.3f}  "
          f"{time.time() - start:.0f} s")
  epsilon, delta = private.ledger.guarantee()
  out = dict(
      params=params, steps=private.steps, epsilon=epsilon, delta=delta,
      noise_multiplier=private.noise_multiplier, sensitivity=private.sensitivity,
      clip_norm=private.clip_norm, sampling_rate=private.sampling_rate,
      clipped_at_start=clipped_at_start, method=private.method,
      learning_rate=config.learning_rates[method], temperature=config.temperature,
      train_seconds=time.time() - start, resumed_at_step=first,
      shared_parameters=logit_dp.clip_methods.shared_parameters(embed_images, embed_texts, params,
                                                                *test_pairs))
  if grouped:
    out.update(group_size=config.dp_gcl.group_size, num_groups=private.grad_fn.num_groups)
  out.update(unit=private.ledger.unit, max_pairs_per_user=private.max_pairs_per_user,
             num_units=private.sampler.num_units)
  if mode == "group_privacy":  # the per-pair guarantee converted to a person of ≤ K pairs
    out.update(epsilon_per_pair=epsilon, delta_per_pair=delta, max_pairs_per_user=k,
               unit="person (group privacy)", num_records_capped=num_records)
    out["epsilon"], out["delta"] = group_privacy(epsilon, delta, k)
  return out


def train_logit_dp(config, ds, tokens, towers, workdir: str, log) -> dict[str, Any]:
  """Logit-DP with two towers (`train_private`)."""
  return train_private(config, ds, tokens, towers, workdir, log, "logit_dp")


def train_non_private(config, ds, tokens, towers, log) -> dict[str, Any]:
  """Shuffled epochs, Adam on the plain gradient of the same contrastive loss."""
  embed_images, embed_texts, params = towers
  loss = logit_dp.losses.contrastive(config.temperature)
  trainable = trainable_of(config)
  optimizer = optax.adam(config.learning_rates.non_private)
  if trainable is not None:  # the frozen leaves: no gradient, no update, no state
    optimizer = logit_dp.finetune.masked_optimizer(optimizer, trainable)
  opt_state = optimizer.init(params)

  @jax.jit
  def step_fn(params, opt_state, x, texts, mask):
    objective = lambda p: loss(
        logit_dp.losses.cosine_similarity(embed_images(p, x), embed_texts(p, texts)), mask)
    value, grads = jax.value_and_grad(objective)(params)
    if trainable is not None:
      grads = jax.tree_util.tree_map(lambda g, t: g if t else jnp.zeros_like(g), grads,
                                     logit_dp.finetune.trainable_mask(trainable, grads))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if trainable is not None:
      trained, _ = logit_dp.finetune.partition(new_params, trainable)
      _, frozen = logit_dp.finetune.partition(params, trainable)
      new_params = logit_dp.finetune.combine(trained, frozen)
    return new_params, opt_state, value

  batcher = logit_dp.sampling.ShuffledBatcher(len(ds["y_train"]), config.batch_size,
                                              seed=config.seed)
  start, steps = time.time(), 0
  for epoch in range(int(np.ceil(config.num_epochs))):
    for indices, mask in batcher.epoch(epoch):
      x, texts = _pairs(ds, tokens, indices)
      params, opt_state, value = step_fn(params, opt_state, x, texts, mask)
      steps += 1
      if not np.isfinite(float(value)):
        raise FloatingPointError(f"non-private step {steps}: the loss is not finite.")
      if steps % config.log_every == 0:
        log(f"non_private step {steps}  loss {float(value):.3f}  {time.time() - start:.0f} s")
  return dict(params=params, steps=steps, train_seconds=time.time() - start,
              learning_rate=config.learning_rates.non_private, temperature=config.temperature)


def _results_path(workdir: str) -> str:
  return os.path.join(workdir, "results.json")


def read_results(workdir: str) -> dict[str, Any] | None:
  """The results.json of a clip run in ``workdir`` (None if there is none)."""
  path = _results_path(workdir)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def is_finished(workdir: str, methods=None) -> bool:
  """Whether results.json holds every method of ``methods`` (default: those its config.json
  lists)."""
  results = read_results(workdir)
  if results is None:
    return False
  if methods is None:
    with open(os.path.join(workdir, "config.json")) as f:
      methods = json.load(f)["methods"]
  return all(m in results.get("methods", {}) for m in methods)


def _training_settings(config: dict) -> dict:
  return {k: v for k, v in workdirs.shareable_config(config).items() if k not in _RUN_ONLY_FIELDS}


def check_resumable(config, workdir: str) -> None:
  """ValueError when ``workdir`` holds a clip run made with other training settings."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return
  with open(path) as f:
    old = json.load(f)
  if _training_settings(old) != _training_settings(json.loads(config.to_json_best_effort())):
    raise ValueError(f"{workdir} holds a clip run with other training settings ({path}): use "
                     "another workdir (or delete this one).")


def run(config: ml_collections.ConfigDict, workdir: str, quiet: bool = False) -> dict[str, Any]:
  """Trains every method of config.methods, evaluates zero-shot accuracy, writes results.

  A re-run on the same workdir (same training settings) keeps the methods results.json already
  holds and resumes the others from their checkpoints.
  """
  log = (lambda s: None) if quiet else print
  unknown = [m for m in config.methods if m not in METHODS]
  if unknown:
    raise ValueError(f"unknown method(s) {unknown}: use {METHODS}.")
  check_resumable(config, workdir)
  os.makedirs(workdir, exist_ok=True)
  workdirs.write_config(config, os.path.join(workdir, "config.json"))
  ds = load_images(config)
  texts = class_texts(ds["names"], config.text_template)
  vocab = Vocabulary(texts + vocabulary_texts(config))
  tokens = vocab.tokenize(texts)
  towers = make_towers(config, len(vocab), ds["x_train"].shape[1:],
                       jax.tree_util.tree_map(lambda a: a[:1], tokens))
  if config.get("init_from"):  # fine-tuning: the towers start from saved (pretrained) params
    towers = (*towers[:2], load_params(config.init_from, towers[2]))
  results: dict[str, Any] = dict(num_records=int(len(ds["y_train"])),
                                 num_test=int(len(ds["y_test"])), num_classes=len(texts),
                                 vocabulary_size=len(vocab), example_text=texts[0], methods={})
  earlier = read_results(workdir)
  if earlier is not None:
    results["methods"].update(earlier.get("methods", {}))
  for method in config.methods:
    if method in results["methods"]:
      log(f"{method}: finished earlier, kept")
      continue
    if method == "non_private":
      out = train_non_private(config, ds, tokens, towers, log)
    else:
      out = train_private(config, ds, tokens, towers, workdir, log, method)
    params = out.pop("params")
    if config.get("save_params"):
      save_params(os.path.join(workdir, "params", method), params)
    out.update(
        zero_shot(towers[0], towers[1], params, ds["x_test"], ds["y_test"], tokens,
                  config.eval_batch_size))
    results["methods"][method] = out
    workdirs.write_json(_results_path(workdir), results)
    log(f"{METHOD_LABELS[method]}: zero-shot top-1 {out['zero_shot_top1']:.4f}, "
        f"top-5 {out['zero_shot_top5']:.4f}")
  workdirs.write_json(_results_path(workdir), results)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(format_table(results) + "\n")
  log(format_table(results))
  return results


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       quiet: bool = False) -> dict[str, Any]:
  """`run`, the entry point of `experiments.tune` and `experiments.clip_benchmark`."""
  return run(config, workdir, quiet=quiet)


def search_result(workdir: str) -> dict[str, Any]:
  """The record `experiments.tune` ranks: the run's one method, zero-shot top-1 as accuracy."""
  results = read_results(workdir)
  (method,) = results["methods"]
  r = results["methods"][method]
  return dict(steps=int(r["steps"]), noise_multiplier=r.get("noise_multiplier"),
              sampling_rate=r.get("sampling_rate"), epsilon=r.get("epsilon"), delta=r.get("delta"),
              clip_norm=r.get("clip_norm"), accuracy=float(r["zero_shot_top1"]),
              zero_shot_top5=float(r["zero_shot_top5"]), train_seconds=r.get("train_seconds"))


def format_table(results: dict[str, Any]) -> str:
  """The results as a markdown table; ε states its unit (per pair or per person)."""
  rows = [
      "| method | ε | δ | steps | zero-shot top-1 | zero-shot top-5 |", "|---|---|---|---|---|---|"
  ]
  for method, r in results["methods"].items():
    eps = f"{r['epsilon']:.2f} per {r.get('unit', 'pair')}" if "epsilon" in r else "∞"
    delta = f"{r['delta']:.0e}" if "delta" in r else "–"
    rows.append(f"| {METHOD_LABELS[method]} | {eps} | {delta} | {r['steps']} | "
                f"{r['zero_shot_top1']:.4f} | {r['zero_shot_top5']:.4f} |")
  rows.append(f"\nchance: top-1 {1 / results['num_classes']:.4f}, "
              f"top-5 {min(5, results['num_classes']) / results['num_classes']:.4f}")
  return "\n".join(rows)


def main(argv):
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  workdir = flags.FLAGS.workdir or train_lib.default_workdir(flags.FLAGS["config"].config_filename,
                                                             "clip")
  print(f"workdir: {workdir}")
  compilation_cache.enable_from_flags(workdir)
  run(flags.FLAGS.config, workdir)
  print(f"results: {os.path.join(workdir, 'results.md')}")


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  here = os.path.dirname(os.path.abspath(__file__))
  config_flags.DEFINE_config_file("config", os.path.join(here, "configs", "clip_cifar100.py"),
                                  "Training configuration (a file under experiments/configs/).",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Results folder (default: runs/clip_<config name>).")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)
