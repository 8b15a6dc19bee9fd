"""Tests of experiments.evaluation against brute-force / scikit-learn references."""

import os
import sys

# `experiments/` is not an installed package: make the repository root importable
# (also when pytest is started as `pytest` rather than `python -m pytest`).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import pytest

from experiments import evaluation


def brute_force_knn(train, train_y, test, k, num_classes):
  """Reference: cosine similarity, top-k, majority vote; ties -> the tied class whose
  nearest neighbour ranks first."""
  tr = train / np.linalg.norm(train, axis=1, keepdims=True)
  te = test / np.linalg.norm(test, axis=1, keepdims=True)
  out = []
  for row in te:
    sims = tr @ row
    order = np.argsort(-sims, kind="stable")[:k]
    labels = train_y[order]
    counts = np.bincount(labels, minlength=num_classes)
    best = counts.max()
    for lab in labels:  # most similar first
      if counts[lab] == best:
        out.append(lab)
        break
  return np.array(out)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_knn_matches_brute_force(k):
  rng = np.random.default_rng(k)
  train = rng.normal(size=(200, 6)).astype(np.float32)
  train_y = rng.integers(0, 4, size=200)
  test = rng.normal(size=(150, 6)).astype(np.float32)
  got = evaluation.knn_predict(train, train_y, test, k=k, num_classes=4, chunk=64)
  want = brute_force_knn(train, train_y, test, k, 4)
  np.testing.assert_array_equal(got, want)


def test_knn_uses_cosine_not_euclidean():
  # Same direction, very different norms: cosine neighbours, not Euclidean ones.
  train = np.array([[100.0, 0.0], [0.0, 0.1], [0.0, 0.2], [0.0, 0.3]])
  train_y = np.array([0, 1, 1, 1])
  test = np.array([[0.1, 0.0]])
  assert evaluation.knn_predict(train, train_y, test, k=1)[0] == 0


def test_knn_three_way_tie_goes_to_nearest():
  train = np.array([[1.0, 0.0], [0.9, 0.3], [0.8, 0.6]])
  train_y = np.array([2, 0, 1])
  test = np.array([[1.0, 0.01]])
  assert evaluation.knn_predict(train, train_y, test, k=3, num_classes=3)[0] == 2


def test_confusion_and_per_class_metrics_match_sklearn():
  from sklearn.metrics import confusion_matrix
  from sklearn.metrics import precision_recall_fscore_support
  rng = np.random.default_rng(0)
  y = rng.integers(0, 5, 300)
  p = np.where(rng.random(300) < 0.6, y, rng.integers(0, 5, 300))
  p[p == 4] = 3  # class 4 is never predicted: precision undefined -> 0
  cm = evaluation.confusion_matrix(y, p, 5)
  np.testing.assert_array_equal(cm, confusion_matrix(y, p, labels=range(5)))
  for beta in (1.0, 2.0, 0.5):
    pc = evaluation.per_class_metrics(cm, beta)
    prec, rec, f, _ = precision_recall_fscore_support(y, p, beta=beta, labels=range(5),
                                                      zero_division=0)
    np.testing.assert_allclose(pc["precision"], prec)
    np.testing.assert_allclose(pc["recall"], rec)
    np.testing.assert_allclose(pc["fbeta"], f)
  s = evaluation.classification_summary(y, p, 5)
  assert s["accuracy"] == pytest.approx(np.mean(y == p))
  assert s["best_recall"] == pytest.approx(rec.max())


def test_relative_metrics():
  rel = evaluation.relative_metrics({"accuracy": 0.3, "best_recall": 0.5, "x": 1},
                                    {"accuracy": 0.6, "best_recall": 0.5})
  assert rel == {"accuracy": 0.5, "best_recall": 1.0}


def test_linear_probe_separable_and_chance():
  rng = np.random.default_rng(0)
  y = rng.integers(0, 3, 300)
  centers = np.eye(3) * 10
  x = centers[y] + rng.normal(size=(300, 3))
  assert evaluation.linear_probe_accuracy(x[:200], y[:200], x[200:], y[200:]) == 1.0
  noise = rng.normal(size=(300, 3))
  assert evaluation.linear_probe_accuracy(noise[:200], y[:200], noise[200:], y[200:]) < 0.6


def test_embed_batches():
  f = lambda params, x: x.reshape(x.shape[0], -1) * params
  x = np.arange(2 * 7 * 4, dtype=np.float32).reshape(7, 2, 4)
  np.testing.assert_allclose(evaluation.embed(f, 2.0, x, batch_size=3), x.reshape(7, 8) * 2)
