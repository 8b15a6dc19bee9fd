"""Evaluation of embeddings: k-NN (cosine, majority vote), confusion matrices,
per-class recall / precision / F_beta as in the paper's tables, metrics relative to
the non-private run, and a linear probe.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "knn_predict", "confusion_matrix", "per_class_metrics", "classification_summary",
    "relative_metrics", "linear_probe_accuracy", "embed"
]


def embed(apply_fn, params, x: np.ndarray, batch_size: int = 1000, preprocess=None) -> np.ndarray:
  """Embeds ``x`` in batches with ``apply_fn(params, x)`` (pass a jitted function)."""
  out = []
  for i in range(0, len(x), batch_size):
    xb = x[i:i + batch_size]
    out.append(np.asarray(apply_fn(params, jnp.asarray(preprocess(xb) if preprocess else xb))))
  return np.concatenate(out, axis=0)


def _normalize(z):
  z = jnp.asarray(z, jnp.float32)
  return z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-12)


@functools.partial(jax.jit, static_argnames=("k", "num_classes"))
def _knn_chunk(test_unit, train_unit, train_y, *, k: int, num_classes: int):
  sims = test_unit @ train_unit.T
  _, nn_idx = jax.lax.top_k(sims, k)  # (c, k), most similar first
  onehot = jax.nn.one_hot(train_y[nn_idx], num_classes)  # (c, k, C)
  votes = onehot.sum(1)
  # Tie-break: a bonus < 1 that decreases with the rank of each class's nearest neighbour.
  rank_w = (k - jnp.arange(k)) / (k + 1.0)
  return jnp.argmax(votes + (onehot * rank_w[None, :, None]).max(1), axis=-1)


def knn_predict(train_emb, train_y, test_emb, k: int = 3, num_classes: int | None = None,
                chunk: int = 1024) -> np.ndarray:
  """k-NN by cosine similarity with majority vote.

  Ties between classes with the same number of votes go to the tied class whose
  nearest neighbour is most similar.  Processes ``chunk`` test rows at a time
  (the last chunk is padded so that a single compilation is reused).
  """
  train_y = np.asarray(train_y)
  num_classes = int(num_classes or train_y.max() + 1)
  k = int(min(k, len(train_y)))
  tr, ty = _normalize(train_emb), jnp.asarray(train_y, jnp.int32)
  te = _normalize(test_emb)
  n = te.shape[0]
  chunk = int(min(chunk, n))
  pad = (-n) % chunk
  te = jnp.concatenate([te, jnp.zeros((pad, te.shape[1]), te.dtype)])
  preds = [
      np.asarray(_knn_chunk(te[i:i + chunk], tr, ty, k=k, num_classes=num_classes))
      for i in range(0, n + pad, chunk)
  ]
  return np.concatenate(preds)[:n].astype(np.int32)


def confusion_matrix(y_true, y_pred, num_classes: int) -> np.ndarray:
  """``cm[t, p]`` = number of test points of true class ``t`` predicted as ``p``."""
  cm = np.zeros((num_classes, num_classes), np.int64)
  np.add.at(cm, (np.asarray(y_true), np.asarray(y_pred)), 1)
  return cm


def per_class_metrics(cm: np.ndarray, beta: float = 1.0) -> dict[str, np.ndarray]:
  """Per-class recall, precision and F_beta from a confusion matrix (0 where undefined)."""
  cm = np.asarray(cm, np.float64)
  tp = np.diag(cm)
  with np.errstate(divide="ignore", invalid="ignore"):
    recall = np.where(cm.sum(1) > 0, tp / cm.sum(1), 0.0)
    precision = np.where(cm.sum(0) > 0, tp / cm.sum(0), 0.0)
    b2 = beta ** 2
    denom = b2 * precision + recall
    fbeta = np.where(denom > 0, (1 + b2) * precision * recall / denom, 0.0)
  return dict(recall=recall, precision=precision, fbeta=fbeta)


def classification_summary(y_true, y_pred, num_classes: int, beta: float = 1.0) -> dict:
  """Accuracy, confusion matrix and best (max over classes) recall / precision / F_beta.

  The paper's tables report, per method, the accuracy and the best class-wise recall,
  precision and F score; we also give the macro averages.
  """
  cm = confusion_matrix(y_true, y_pred, num_classes)
  pc = per_class_metrics(cm, beta)
  return dict(accuracy=float(np.mean(np.asarray(y_true) == np.asarray(y_pred))),
              best_recall=float(pc["recall"].max()), best_precision=float(pc["precision"].max()),
              best_fbeta=float(pc["fbeta"].max()), macro_recall=float(pc["recall"].mean()),
              macro_precision=float(pc["precision"].mean()), macro_fbeta=float(pc["fbeta"].mean()),
              confusion_matrix=cm, per_class=pc)


SCALAR_KEYS = ("accuracy", "best_recall", "best_precision", "best_fbeta", "linear_probe")


def relative_metrics(metrics: dict, reference: dict, keys=SCALAR_KEYS) -> dict[str, float]:
  """``metrics[k] / reference[k]`` for the scalar metrics in both (reference: non-private)."""
  out = {}
  for k in keys:
    if k in metrics and k in reference and reference[k]:
      out[k] = float(metrics[k]) / float(reference[k])
  return out


def linear_probe_accuracy(train_emb, train_y, test_emb, test_y, seed: int = 0,
                          max_iter: int = 1000) -> float:
  """Test accuracy of a multinomial logistic regression on frozen (standardised) embeddings."""
  from sklearn.linear_model import LogisticRegression
  from sklearn.pipeline import make_pipeline
  from sklearn.preprocessing import StandardScaler
  clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=max_iter, random_state=seed))
  clf.fit(np.asarray(train_emb, np.float64), np.asarray(train_y))
  return float(clf.score(np.asarray(test_emb, np.float64), np.asarray(test_y)))
