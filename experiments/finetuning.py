"""Fine-tuning a classification head on frozen pre-trained encoders (CIFAR-100 coarse).

``finetune_and_evaluate(config, workdir)`` reads the pre-training results folder
``config.pretrain_workdir`` (its ``config.json`` rebuilds the encoder, each method's
``params`` checkpoint gives the weights), embeds the fine-tuning data with every
frozen encoder, trains ``FinetuneHead`` (64-32-``num_classes``) with Adam and
cross-entropy on shuffled epochs, and reports test accuracy, best per-class
recall / precision / F_β and the same relative to the non-private encoder.

The head is trained non-privately: in the paper's setting the private data is the
pre-training data (CIFAR-10); the encoder carries its (ε, δ) guarantee into every
fine-tuned model by post-processing.
"""

from __future__ import annotations

import csv
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import logit_dp.sampling
from experiments import data as data_lib
from experiments import evaluation
from experiments import train as train_lib
from logit_dp import models


def load_pretrained(pretrain_workdir: str, method: str, pre_config):
  """Restores the final encoder params of ``method`` from a pre-training folder."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  _, _, _, init_fn = train_lib.get_model(pre_config.model)
  with open(os.path.join(pretrain_workdir, "input_shape.json")) as f:
    shape = tuple(json.load(f))
  if method == train_lib.UNTRAINED:  # the pre-training seed's initial parameters
    return train_lib.initial_params(pre_config, jnp.zeros((1,) + shape, jnp.float32))
  path = os.path.abspath(os.path.join(pretrain_workdir, method, "params"))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{path} not found: has `pretrain.py` finished for {method}?")
  template = init_fn(jax.random.PRNGKey(0), jnp.zeros((1,) + shape, jnp.float32))
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(path, template)


def read_pretrain(pretrain_workdir: str):
  """(config, results) of a pretrain.py workdir: its config.json, and its results.json or {}."""
  if not pretrain_workdir:
    raise ValueError(
        "Set --config.pretrain_workdir to the --workdir of a finished pretrain.py run.")
  with open(os.path.join(pretrain_workdir, "config.json")) as f:
    pre_config = ml_collections.ConfigDict(json.load(f))
  results = {}
  rpath = os.path.join(pretrain_workdir, "results.json")
  if os.path.exists(rpath):
    with open(rpath) as f:
      results = json.load(f)
  return pre_config, results


@functools.partial(jax.jit, static_argnums=(0, 1))
def _head_step(head, lr, params, opt_state, e_tr, y_tr, idx, mask):
  """One Adam step of cross-entropy on the frozen embeddings (compiled once per head)."""
  tx = optax.adam(lr)

  def loss_fn(p):
    logits = head.apply(p, e_tr[idx])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y_tr[idx])
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

  loss, g = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(g, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnums=0)
def _head_predict(head, params, e):
  return jnp.argmax(head.apply(params, e), -1)


def standardize(e_tr, e_te):
  """Per-feature (e - mean) / std with the fine-tuning train split's statistics (public data).

  Private encoders can give embeddings with a large common offset and norms of 10 or more
  (the cosine loss does not see the norm); Adam at lr 1e-2 on such inputs has driven the head
  to predict one class. An affine map of the inputs changes nothing the head could not learn.
  """
  mean, std = e_tr.mean(0), e_tr.std(0)
  std = np.where(std > 0, std, 1.0)
  return (e_tr - mean) / std, (e_te - mean) / std


def train_head(config, e_tr, y_tr, e_te, num_classes: int, csv_path: str, y_te=None):
  """Trains the head on frozen embeddings; returns (params, test predictions)."""
  if config.get("standardize_embeddings", False):
    e_tr, e_te = standardize(np.asarray(e_tr, np.float32), np.asarray(e_te, np.float32))
  head = models.FinetuneHead(hidden=tuple(config.head_hidden), num_classes=num_classes)
  key = jax.random.PRNGKey(config.seed)
  params = head.init(key, jnp.zeros((1, e_tr.shape[1])))
  tx = optax.adam(config.learning_rate)
  opt_state = tx.init(params)
  e_tr_d, y_tr_d = jnp.asarray(e_tr), jnp.asarray(y_tr)
  step = functools.partial(_head_step, head, float(config.learning_rate))
  predict = functools.partial(_head_predict, head)
  batcher = logit_dp.sampling.ShuffledBatcher(len(y_tr), int(config.batch_size), seed=config.seed)
  with open(csv_path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["epoch", "train_loss", "test_accuracy"])
    for epoch in range(int(config.num_epochs)):
      losses = []
      for idx, mask in batcher.epoch(epoch):
        params, opt_state, loss = step(params, opt_state, e_tr_d, y_tr_d, idx, mask)
        losses.append(float(loss))
      acc = float("nan")
      if y_te is not None:
        acc = float(np.mean(np.asarray(predict(params, jnp.asarray(e_te))) == y_te))
      w.writerow([epoch + 1, float(np.mean(losses)), acc])
  return params, np.asarray(predict(params, jnp.asarray(e_te)))


def finetune_and_evaluate(config, workdir: str, quiet: bool = False) -> dict[str, dict[str, Any]]:
  os.makedirs(workdir, exist_ok=True)
  train_lib.save_config(config, workdir)
  pre_config, pre_results = read_pretrain(config.pretrain_workdir)
  ds = data_lib.load_dataset(config.data, seed=config.seed)
  methods = [
      m for m in (config.methods or pre_config.methods) if m == train_lib.UNTRAINED
      or os.path.isdir(os.path.join(config.pretrain_workdir, m, "params"))
  ]
  if not methods:
    raise FileNotFoundError(f"No finished pre-training run in {config.pretrain_workdir}.")
  _, _, apply_jit, _ = train_lib.get_model(pre_config.model)
  results = {}
  for m in methods:
    params = load_pretrained(config.pretrain_workdir, m, pre_config)
    e_tr = evaluation.embed(apply_jit, params, ds["x_train"], preprocess=data_lib.to_float)
    e_te = evaluation.embed(apply_jit, params, ds["x_test"], preprocess=data_lib.to_float)
    os.makedirs(os.path.join(workdir, m), exist_ok=True)
    _, pred = train_head(config, e_tr, ds["y_train"], e_te, ds["num_classes"],
                         os.path.join(workdir, m, "metrics.csv"), y_te=ds["y_test"])
    r = evaluation.classification_summary(ds["y_test"], pred, ds["num_classes"], beta=config.f_beta)
    if config.get("linear_probe", True):
      r["linear_probe"] = evaluation.linear_probe_accuracy(e_tr, ds["y_train"], e_te, ds["y_test"],
                                                           seed=config.seed)
    pr = pre_results.get(m, {})
    r.update(method=m, epsilon=pr.get("epsilon", 0.0), delta=pr.get("delta", 0.0),
             noise_multiplier=pr.get("noise_multiplier", 0.0), history=[])
    results[m] = r
  table = train_lib.format_table(results, acc_label="head acc")
  if not quiet:
    print(table)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write("Fine-tuning: head accuracy and per-class metrics of the head's predictions\n\n" + table
            + "\n")
  train_lib.plot_results(results, workdir, data_lib.class_names(config.data, ds["num_classes"]))
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(train_lib._jsonable(results), f, indent=1)  # pylint: disable=protected-access
  return results
