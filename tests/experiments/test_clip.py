"""experiments/clip.py: CLIP-style two-tower training end to end at a tiny size (synthetic
images, class names from a JSON file), and its pieces (vocabulary, zero-shot accuracy)."""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import clip
from experiments.configs import clip_cifar10
from experiments.configs import clip_cifar100
from experiments.configs import clip_people_tiny
from experiments.configs import clip_tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = ["apple", "maple_tree", "lawn_mower", "sea", "aquarium_fish"]


def _names_file(tmp_path) -> str:
  path = tmp_path / "names.json"
  path.write_text(json.dumps({"fine_label_names": NAMES, "coarse_label_names": ["x"]}))
  return str(path)


def test_texts_and_vocabulary():
  texts = clip.class_texts(NAMES, "a photo of a {}")
  assert texts[1] == "a photo of a maple tree"
  vocab = clip.Vocabulary(texts)
  tokens = vocab.tokenize(texts)
  assert tokens["ids"].shape == (5, 6) and tokens["mask"].dtype == bool
  assert [vocab.words[i] for i in tokens["ids"][1] if i
         ] == ["a", "photo", "of", "a", "maple", "tree"]
  assert tokens["mask"].sum(axis=1).tolist() == [5, 6, 6, 5, 6]
  assert len({tuple(r) for r in tokens["ids"]}) == 5  # every class its own text


def test_label_names_errors(tmp_path):
  with pytest.raises(ValueError, match="label_names"):
    clip.load_label_names(None, name="svhn")  # no file ships for it
  path = tmp_path / "bad.json"
  path.write_text(json.dumps({"other": []}))
  with pytest.raises(ValueError, match="fine_label_names"):
    clip.load_label_names(str(path))


def test_class_names_ship_with_the_repository():
  """The quick run needs no file from outside a clean checkout: the class names are tracked."""
  fine = clip.load_label_names(None, "fine", "cifar100")
  assert len(fine) == len(set(fine)) == 100 and fine[:2] == ["apple", "aquarium_fish"]
  assert len(clip.load_label_names(None, "coarse", "cifar100")) == 20
  assert clip.load_label_names(None, "fine", "cifar10")[:3] == ["airplane", "automobile", "bird"]
  tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "experiments/label_names"],
                           cwd=REPO, capture_output=True, text=True)
  if tracked.returncode != 128 or "not a git repository" not in tracked.stderr:
    assert tracked.returncode == 0, tracked.stderr
  cifar10 = clip_cifar10.get_config()
  assert len(clip.load_label_names(cifar10.data.label_names, cifar10.data.label,
                                   cifar10.data.name)) == 10
  config = clip_tiny.get_config()
  assert config.data.label_names is None
  ds = clip.load_images(config)  # synthetic images, the shipped names
  assert ds["names"] == fine and ds["y_train"].max() < 100


def test_zero_shot_accuracy_is_argmax_of_cosine():
  """Images embedded as the one-hot of their class (classes 0, 1, 2 of 3): all correct; the
  same with the class texts permuted: all wrong at top-1."""
  tokens = {"ids": jnp.arange(3)[:, None], "mask": jnp.ones((3, 1), bool)}
  images = np.array([0, 1, 2, 2])
  labels = np.array([0, 1, 2, 2])
  embed_images = lambda p, x: jnp.eye(3)[x]
  right = lambda p, t: jnp.eye(3)[t["ids"][:, 0]]
  wrong = lambda p, t: jnp.eye(3)[(t["ids"][:, 0] + 1) % 3]
  assert clip.zero_shot(embed_images, right, None, images, labels, tokens, 2)["zero_shot_top1"] == 1
  assert clip.zero_shot(embed_images, wrong, None, images, labels, tokens, 3)["zero_shot_top1"] == 0


@pytest.mark.slow  # a second tiny training run (test_experiments keeps one by default); the
# two-tower gradients are checked against jax.grad by test_two_tower
def test_tiny_run_end_to_end(tmp_path):
  config = clip_tiny.get_config()
  config.data.label_names = _names_file(tmp_path)
  workdir = str(tmp_path / "run")
  results = clip.run(config, workdir, quiet=True)
  private, plain = results["methods"]["logit_dp"], results["methods"]["non_private"]
  assert private["shared_parameters"] == []  # disjoint towers: the exact, triangle-cost path
  # The certified δ (overflow term of the padded batches included) is within the target:
  # make_private calibrates σ at δ minus that term.
  assert 0 < private["epsilon"] <= config.target_epsilon
  assert 0.99 * config.target_delta < private["delta"] <= config.target_delta
  assert private["sensitivity"] == pytest.approx(2 * (1 + np.exp(2.0)) * config.clip_norm,
                                                 rel=1e-3)  # sup_n C for τ = 1
  assert private["steps"] == 13 and plain["steps"] == 13  # ⌈1 epoch / q⌉, ⌈200 / 16⌉
  # Class-coloured images: the non-private towers learn them well above chance (0.2).
  assert plain["zero_shot_top1"] > 0.5
  with open(os.path.join(workdir, "results.json")) as f:
    assert json.load(f)["methods"]["logit_dp"]["steps"] == private["steps"]
  assert os.path.exists(os.path.join(workdir, "config.json"))


@pytest.mark.slow
def test_command_line_runs(tmp_path):
  args = [
      sys.executable, "-m", "experiments.clip", "--config=experiments/configs/clip_tiny.py",
      "--config.methods=('non_private',)", f"--workdir={tmp_path / 'cli'}"
  ]
  r = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "zero-shot top-1" in r.stdout


@pytest.mark.slow
def test_real_cifar100_pairs_and_texts():
  """The real data: 100 names, every label has its text (skipped without the data)."""
  npz_dir = os.environ.get("LOGIT_DP_CIFAR_DIR")
  names = os.environ.get("LOGIT_DP_CIFAR100_NAMES")
  if not npz_dir or not names or not os.path.exists(os.path.join(npz_dir, "cifar100.npz")):
    pytest.skip("set LOGIT_DP_CIFAR_DIR (with cifar100.npz) and LOGIT_DP_CIFAR100_NAMES")
  config = clip_cifar100.get_config()
  config.data.npz_dir, config.data.label_names = npz_dir, names
  config.data.train_subset, config.data.test_subset = 500, 200
  ds = clip.load_images(config)
  assert len(ds["names"]) == 100 and ds["x_train"].shape[1:] == (32, 32, 3)
  assert ds["y_train"].max() < 100


def test_simulated_owners_hold_every_record_with_1_to_max_pairs():
  owners = clip.simulate_owners(500, max_pairs=16, alpha=1.5, seed=3)
  assert owners.shape == (500,)
  counts = np.bincount(owners)
  assert counts.min() >= 1 and counts.max() <= 16 and counts.sum() == 500
  assert np.mean(counts == 1) > np.mean(counts == 16)  # heavy-tailed: many small owners
  np.testing.assert_array_equal(owners, clip.simulate_owners(500, 16, 1.5, 3))


@pytest.mark.slow  # two private two-tower trainings (privacy per person), a minute on 2 cores
def test_tiny_run_per_person_end_to_end(tmp_path):
  """clip_people_tiny: Logit-DP and DP-GCL run natively per person on simulated owners: q over
  people, C per person (K·C for Logit-DP, 2B for DP-GCL), ε per person in results and table."""
  config = clip_people_tiny.get_config()
  config.data.label_names = _names_file(tmp_path)
  workdir = str(tmp_path / "run")
  results = clip.run(config, workdir, quiet=True)
  people = len(np.unique(clip.simulate_owners(200, 4, 1.5, 0)))
  for method in ("logit_dp", "dp_gcl"):
    r = results["methods"][method]
    assert r["unit"] == "person" and r["max_pairs_per_user"] == 2 and r["num_units"] == people
    assert r["sampling_rate"] == pytest.approx(6 / people)
    assert 0 < r["epsilon"] <= config.target_epsilon
  assert results["methods"]["logit_dp"]["sensitivity"] == pytest.approx(
      2 * 2 * (1 + np.exp(2.0)) * config.clip_norm, rel=1e-3)  # K·sup_n C, τ = 1
  assert results["methods"]["dp_gcl"]["sensitivity"] == pytest.approx(2 * config.clip_norm)
  with open(os.path.join(workdir, "results.md")) as f:
    assert "per person" in f.read()


def test_group_privacy_target_and_capped_records():
  """The per-pair target's group privacy at K pairs is the person-level (ε, δ); the capped
  records hold min(K, own) records of every owner."""
  for eps, delta, k in ((1.0, 1e-5, 2), (8.0, 1e-5, 4), (3.0, 1e-6, 1)):
    eps_pair, delta_pair = clip.group_privacy_target(eps, delta, k)
    assert clip.group_privacy(eps_pair, delta_pair, k) == pytest.approx((eps, delta), rel=1e-12)
  owners = clip.simulate_owners(300, 16, 1.5, 0)
  keep = clip.capped_records(owners, 3, 0)
  np.testing.assert_array_equal(np.bincount(owners[keep], minlength=owners.max() + 1),
                                np.minimum(np.bincount(owners), 3))


@pytest.mark.slow  # a private two-tower training on the K-capped records
def test_tiny_run_of_the_group_privacy_baseline(tmp_path):
  """mode="group_privacy": per-pair DP-GCL on the K-capped records at the per-pair target, its
  (ε, δ) converted by group privacy to at most the person-level target."""
  config = clip_people_tiny.get_config()
  config.data.label_names = _names_file(tmp_path)
  config.people.mode = "group_privacy"
  config.methods = ("dp_gcl",)
  r = clip.run(config, str(tmp_path / "run"), quiet=True)["methods"]["dp_gcl"]
  owners = clip.simulate_owners(200, 4, 1.5, 0)
  assert r["unit"] == "person (group privacy)" and r["max_pairs_per_user"] == 2
  assert r["num_records_capped"] == np.minimum(np.bincount(owners), 2).sum() == r["num_units"]
  assert r["epsilon_per_pair"] <= config.target_epsilon / 2
  assert (r["epsilon"], r["delta"]) == pytest.approx(
      clip.group_privacy(r["epsilon_per_pair"], r["delta_per_pair"], 2), rel=1e-12)
  assert r["epsilon"] <= config.target_epsilon and r["delta"] <= config.target_delta * (1 + 1e-9)
