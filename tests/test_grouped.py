"""DP-GCL (`baselines.grouped_clipped_grad`): gradients, group assignment, sensitivity audits.

The reference is written independently of the implementation: for every group a Python loop
builds each anchor's logits (own-group positives, other members' extra views), jax.grad of the
group loss in float64, clipped in float64 and summed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import logit_dp
from helpers import flat
from helpers import rel_err
from helpers import tree_norm
from logit_dp import audit
from logit_dp._src import grouped  # noqa: F401
from logit_dp._src import numerics

TOL = 1e-4  # float32 slack on a ratio that must be ≤ 1
KEY = jax.random.PRNGKey(3)


@pytest.fixture
def no_norm_allowance(monkeypatch):
  """Clip by the computed group norm itself, to compare with the exact mechanism."""
  monkeypatch.setattr(numerics, "GRAM_FLOAT_ERROR", 0.0)
  monkeypatch.setattr(numerics, "VECTOR_FLOAT_ERROR", 0.0)


def linear(params, x):
  return x @ params["w"]


def mlp(params, x):
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


def make(kind, n, seed, d_in=3, dim=3, scale=1.0, k=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  if kind == "linear":
    params, fn = {"w": jax.random.normal(keys[0], (d_in, dim))}, linear
  else:
    params = {
        "w1": jax.random.normal(keys[0], (d_in, 5)), "b1": 0.1 * jax.random.normal(keys[1], (5,)),
        "w2": jax.random.normal(keys[2], (5, dim))
    }
    fn = mlp
  x = scale * jax.random.normal(keys[3], (n, d_in))
  x_prime = x + 0.3 * scale * jax.random.normal(keys[4], (n, d_in))
  views = x[:, None] + 0.3 * scale * jax.random.normal(keys[5], (n, k, d_in)) if k else None
  return fn, params, x, x_prime, views


def _unit(e, eps=logit_dp.losses.DEFAULT_COSINE_EPS):
  return e / jnp.sqrt(jnp.sum(e * e, axis=-1, keepdims=True) + eps * eps)


def reference(fn, params, x, x_prime, views, valid, groups, temperature, clip_norm):
  """(Σ_g L_g, Σ_g min(1, B/‖∇L_g‖)·∇L_g) by brute force, in the dtype of the inputs."""
  return _clipped_sum_of_groups(_group_loss(fn, x, x_prime, views, temperature), params,
                                np.asarray(valid), np.asarray(groups), clip_norm)


def _group_loss(fn, x, x_prime, views, temperature):
  """(params, members) ↦ L_g, the loss of the group of those members, by a Python loop over its
  anchors' logits (own-group positives, other members' extra views)."""
  def group_loss(p, members):
    u = _unit(fn(p, x[jnp.asarray(members)]))
    v = _unit(fn(p, x_prime[jnp.asarray(members)]))
    value = 0.0
    for a in range(len(members)):
      logits = [jnp.dot(u[a], v[b]) for b in range(len(members))]
      if views is not None:
        for b, j in enumerate(members):
          if b != a:
            logits += [jnp.dot(u[a], w) for w in _unit(fn(p, views[j]))]
      value += jax.nn.logsumexp(jnp.stack(logits) / temperature) - logits[a] / temperature
    return value

  return group_loss


def _group_gradients(group_loss, params, valid, groups):
  """[(L_g, ∇L_g) for each group g with a valid record, g increasing], each ∇L_g by its own
  jax.grad of L_g = group_loss(params, valid members of g)."""
  return [
      jax.value_and_grad(group_loss)(params,
                                     [i for i in range(len(valid)) if valid[i] and groups[i] == g])
      for g in np.unique(groups[valid])
  ]


def _clipped_sum_of_groups(group_loss, params, valid, groups, clip_norm):
  """(Σ_g L_g, Σ_g min(1, B/‖∇L_g‖)·∇L_g) from `_group_gradients` (all groups in one jitted
  computation)."""
  @jax.jit
  def clipped_sum(params):
    total_loss = 0.0
    total = jax.tree_util.tree_map(jnp.zeros_like, params)
    for value, grad in _group_gradients(group_loss, params, valid, groups):
      norm = jnp.sqrt(sum(jnp.sum(leaf ** 2) for leaf in jax.tree_util.tree_leaves(grad)))
      factor = jnp.minimum(1.0, clip_norm / norm)
      total_loss += value
      total = jax.tree_util.tree_map(lambda t, gr, f=factor: t + f * gr, total, grad)
    return total_loss, total

  return clipped_sum(params)


@functools.cache
def _grad_fn(fn, clip_norm, num_groups, temperature, microbatch_size):
  return logit_dp.baselines.grouped_clipped_grad(fn, logit_dp.losses.contrastive(temperature),
                                                 clip_norm, num_groups,
                                                 microbatch_size=microbatch_size)


def _grads(fn, params, x, x_prime, views, mask, ids, clip_norm, num_groups, temperature=0.7,
           microbatch_size=None):
  grad_fn = _grad_fn(fn, clip_norm, num_groups, temperature, microbatch_size)
  return grad_fn(params, x, x_prime, mask, record_ids=ids, group_key=KEY, extra_views=views)


# The default run keeps the linear model with an extra view and microbatches, clipped; the
# others (and the float32 comparison below) are slow.
@pytest.mark.parametrize("kind,k,microbatch,clip_norm", [
    pytest.param("linear", 0, None, 1e-3, marks=pytest.mark.slow),
    pytest.param("mlp", 2, None, 0.5, marks=pytest.mark.slow),
    pytest.param("mlp", 2, 3, 1e3, marks=pytest.mark.slow),
    ("linear", 1, 4, 0.05),
])
def test_gradient_matches_the_brute_force_reference_in_float64(no_norm_allowance, kind, k,
                                                               microbatch, clip_norm):
  with jax.enable_x64(True):
    fn, params, x, x_prime, views = make(kind, 11, seed=1, k=k)
    params, x, x_prime = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64),
                                                (params, x, x_prime))
    views = None if views is None else views.astype(jnp.float64)
    mask = np.ones(11, bool)
    mask[[2, 7]] = False
    ids = jnp.asarray([5, 90, 3, 41, 17, 8, 66, 12, 30, 2, 77])
    groups = logit_dp.baselines.assign_groups(ids, KEY, 3)
    assert len(np.unique(np.asarray(groups)[mask])) == 3  # every group is used
    ref_loss, ref = reference(fn, params, x, x_prime, views, mask, groups, 0.7, clip_norm)
    loss, got = _grads(fn, params, x, x_prime, views, jnp.asarray(mask), ids, clip_norm, 3,
                       microbatch_size=microbatch)
    assert flat(got).dtype == np.float64 and rel_err(got, ref) < 1e-10
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-12)


@pytest.mark.slow  # float32 accuracy; the float64 reference test and the ≤ B test run by default
def test_float32_gradient_matches_the_float64_reference(no_norm_allowance):
  fn, params, x, x_prime, views = make("mlp", 8, seed=2, k=1)
  ids = jnp.arange(8) * 3 + 1
  loss, got = _grads(fn, params, x, x_prime, views, None, ids, 0.2, 2)
  with jax.enable_x64(True):
    cast = lambda t: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), t)
    ref_loss, ref = reference(fn, cast(params), cast(x), cast(x_prime),
                              cast(views), np.ones(8, bool),
                              logit_dp.baselines.assign_groups(ids, KEY, 2), 0.7, 0.2)
  assert rel_err(got, ref) < 2e-6
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)


@pytest.mark.slow  # a cross-check with Naive-DP; the float64 references are tested by default
def test_one_group_without_extra_views_is_naive_dp(no_norm_allowance):
  fn, params, x, x_prime, _ = make("mlp", 9, seed=4)
  loss = logit_dp.losses.contrastive(0.5)
  for clip_norm in (1e-3,):  # clipped; unclipped is the brute-force test at B = 1e3
    got_loss, got = logit_dp.baselines.grouped_clipped_grad(fn, loss, clip_norm,
                                                            1)(params, x, x_prime,
                                                               record_ids=jnp.arange(9),
                                                               group_key=KEY)
    ref_loss, ref = logit_dp.baselines.naive_clipped_grad(fn, loss, clip_norm)(params, x, x_prime)
    assert rel_err(got, ref) < 1e-6
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)


@pytest.mark.parametrize("scale,spread,log_clip", [
    pytest.param(1.0, 0.3, -6.0, marks=pytest.mark.extended), (100.0, 1e-3, 0.0),
    pytest.param(1e-3, 0.3, -2.0, marks=pytest.mark.slow)
])
def test_released_group_gradients_never_exceed_b_in_float64(scale, spread, log_clip):
  """Stress inputs (tiny B, huge and tiny inputs, near-identical views); B swept across the
  group's own gradient norm, where the float32 norm decides whether to clip."""
  fn, params, x, _, views = make("mlp", 8, seed=5, scale=scale, k=2)
  x_prime = x + spread * scale * jax.random.normal(jax.random.PRNGKey(9), x.shape)
  ids = jnp.arange(8)
  groups = np.asarray(logit_dp.baselines.assign_groups(ids, KEY, 2))
  one_group = jnp.asarray(groups == groups[0])
  # The unclipped group gradient (float32) and its norm in float64.
  _, unclipped = _grads(fn, params, x, x_prime, views, one_group, ids, 1e30, 2)
  norm = np.linalg.norm(flat(unclipped))
  bounds = [10.0 ** log_clip] + list(norm * (1.0 + np.array([-1e-7, 0.0, 1e-7])))
  for bound in bounds:
    _, released = _grads(fn, params, x, x_prime, views, one_group, ids, float(bound), 2)
    assert np.linalg.norm(flat(released)) <= bound, (bound, norm)


def test_assignment_depends_only_on_the_record_id():
  ids = np.random.default_rng(0).choice(50_000, size=300, replace=False)
  groups = np.asarray(logit_dp.baselines.assign_groups(jnp.asarray(ids), KEY, 7))
  # A subset (other records not sampled) and a permuted superset keep every group.
  subset = np.asarray(logit_dp.baselines.assign_groups(jnp.asarray(ids[::3]), KEY, 7))
  np.testing.assert_array_equal(subset, groups[::3])
  superset = np.concatenate([ids, [50_001, 50_002]])[::-1]
  np.testing.assert_array_equal(
      np.asarray(logit_dp.baselines.assign_groups(jnp.asarray(superset), KEY, 7))[2:], groups[::-1])
  # Another key regroups; the buckets are uniform (chi-square over 20,000 ids).
  other = np.asarray(logit_dp.baselines.assign_groups(jnp.asarray(ids), jax.random.PRNGKey(4), 7))
  assert np.mean(other != groups) > 0.7
  counts = np.bincount(np.asarray(logit_dp.baselines.assign_groups(jnp.arange(20_000), KEY, 7)),
                       minlength=7)
  assert scipy.stats.chisquare(counts).pvalue > 1e-4
  assert groups.min() >= 0 and groups.max() < 7


def test_adding_a_record_changes_only_its_own_group():
  """ḡ(S ∪ r) − ḡ(S) is the change of g(r)'s clipped gradient alone, wherever r lands in the
  batch (positions of the other records shift), and the released sum is the same for any
  order of the rows."""
  fn, params, x, x_prime, views = make("mlp", 12, seed=6, k=1)
  ids = jnp.asarray([3, 9, 14, 20, 22, 31, 40, 41, 57, 60, 72, 88])
  groups = np.asarray(logit_dp.baselines.assign_groups(ids, KEY, 3))
  r = 4  # record 22 joins at position 4: S is the batch without it
  keep = np.arange(12) != r
  run = lambda rows, mask=None: _grads(fn, params, x[rows], x_prime[rows], views[rows], mask, ids[
      rows], 0.05, 3)[1]
  with_r, without_r = run(np.arange(12)), run(np.flatnonzero(keep))
  own = groups == groups[r]
  own_with = run(np.arange(12), jnp.asarray(own))
  own_without = run(np.flatnonzero(keep), jnp.asarray(own[keep]))
  change, own_change = flat(with_r) - flat(without_r), flat(own_with) - flat(own_without)
  np.testing.assert_allclose(change, own_change, atol=1e-6 * np.abs(flat(with_r)).max())
  assert np.linalg.norm(change) <= 2 * 0.05
  assert np.linalg.norm(change) > 0
  permuted = np.random.default_rng(1).permutation(12)
  assert rel_err(run(permuted), with_r) < 1e-6


@pytest.mark.slow  # a negative control; test_removal_audit_stays_within_2b audits the hash
def test_groups_by_position_in_the_batch_are_not_private(no_norm_allowance):
  """Chunking the sampled batch into groups by position: deleting one record moves the later
  records into other groups, and ḡ moves by more than 2B. The hash assignment, on the same
  batches, stays within 2B."""
  fn, params, x, x_prime, _ = make("mlp", 12, seed=1)
  clip_norm, num_groups = 1e-3, 6
  core = logit_dp.baselines.grouped_clipped_grad(fn, logit_dp.losses.contrastive(0.5), clip_norm,
                                                 num_groups).core
  ids = np.arange(12)

  def released(rows, groups):
    rows = np.asarray(rows)
    out = core(params, x[rows], x_prime[rows], jnp.ones(len(rows), bool), jnp.asarray(groups),
               None)[1]
    return flat(out)

  def by_position(m):  # consecutive pairs of the sampled batch
    return np.arange(m) // 2

  def by_hash(rows):
    return np.asarray(logit_dp.baselines.assign_groups(jnp.asarray(ids[rows]), KEY, num_groups))

  full = np.arange(12)
  position_gaps, hash_gaps = [], []
  for k in range(12):
    rest = np.delete(full, k)
    position_gaps.append(
        np.linalg.norm(released(full, by_position(12)) - released(rest, by_position(11))))
    hash_gaps.append(np.linalg.norm(released(full, by_hash(full)) - released(rest, by_hash(rest))))
  assert max(position_gaps) > 1.2 * 2 * clip_norm  # the claimed 2B is broken
  assert max(hash_gaps) <= 2 * clip_norm * (1 + TOL)


@pytest.mark.parametrize("kind,k,num_groups,clip_norm",
                         [("linear", 0, 2, 1e-3),
                          pytest.param("mlp", 2, 3, 1.0, marks=pytest.mark.slow),
                          pytest.param("mlp", 1, 1, 0.1, marks=pytest.mark.slow)])
def test_removal_audit_stays_within_2b(kind, k, num_groups, clip_norm):
  fn, params, x, x_prime, _ = make(kind, 8, seed=8)
  views_fn = None
  if k:
    views_fn = lambda a, b: jnp.stack([0.5 * (a + b), 1.3 * a - 0.2][:k], axis=1)
  result = audit.max_removal_ratio(fn, params, logit_dp.losses.contrastive(0.5), clip_norm, x,
                                   x_prime, method="dp_gcl", num_groups=num_groups,
                                   extra_views_fn=views_fn)
  assert result.bound == result.bound_sup == logit_dp.baselines.grouped_sensitivity(clip_norm)
  assert 0 < result.ratio <= 1 + TOL
  searched = audit.search_worst_case(fn, params, logit_dp.losses.contrastive(0.5), clip_norm, x,
                                     x_prime, key=jax.random.PRNGKey(2), num_restarts=6,
                                     num_steps=0, method="dp_gcl", num_groups=num_groups,
                                     extra_views_fn=views_fn)
  assert searched.ratio <= 1 + TOL


def test_sensitivity_b_would_be_wrong():
  """A random batch already moves ḡ by more than B when one record is removed: a group's
  clipped gradient is replaced, not removed, so the bound is 2B, not B."""
  fn, params, x, x_prime, _ = make("linear", 8, seed=1)
  result = audit.max_removal_ratio(fn, params, logit_dp.losses.contrastive(0.5), 1e-3, x, x_prime,
                                   method="dp_gcl", num_groups=2)
  assert 0.5 < result.ratio <= 1 + TOL


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_gradient_ascent_attack_approaches_2b_and_never_exceeds_it(kind):
  fn, params, x, x_prime, _ = make(kind, 8, seed=1)
  views_fn = lambda a, b: jnp.stack([0.5 * (a + b), 1.3 * a - 0.2], axis=1)
  _assert_attack_approaches_2b(fn, params, x, x_prime, 6, extra_views_fn=views_fn)


def _assert_attack_approaches_2b(fn, params, x, x_prime, num_restarts, **kwargs):
  """Gradient ascent at a tiny B (inputs only) and at B = 1 (parameters too) reaches > 0.7 of
  2B and never more than 2B."""
  loss = logit_dp.losses.contrastive(0.5)
  for clip_norm, optimize_params, groups in ((1e-3, False, 2), (1.0, True, 3)):
    found = audit.search_worst_case(fn, params, loss, clip_norm, x, x_prime,
                                    key=jax.random.PRNGKey(0), num_restarts=num_restarts,
                                    num_steps=30, method="dp_gcl", num_groups=groups,
                                    optimize_params=optimize_params, **kwargs)
    assert 0.7 < found.ratio <= 1 + TOL, (clip_norm, found.ratio)


def test_masked_rows_contribute_nothing_even_if_not_finite():
  fn, params, x, x_prime, views = make("mlp", 9, seed=10, k=2)
  ids = jnp.arange(9) + 100
  ref_loss, ref = _grads(fn, params, x, x_prime, views, None, ids, 0.1, 3)
  pad = lambda a, value: jnp.concatenate([a, jnp.full((3,) + a.shape[1:], value, a.dtype)])
  mask = jnp.arange(12) < 9
  padded_ids = jnp.concatenate([ids, jnp.asarray([100, 101, 102])])  # padding may repeat ids
  loss, got = _grads(fn, params, pad(x, jnp.nan), pad(x_prime, jnp.inf), pad(views, 1e30), mask,
                     padded_ids, 0.1, 3)
  assert np.all(np.isfinite(flat(got))) and rel_err(got, ref) < 1e-6
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)


def test_nonfinite_records_raise_eagerly_and_are_dropped_under_jit():
  fn, params, x, x_prime, _ = make("mlp", 6, seed=11)
  grad_fn = logit_dp.baselines.grouped_clipped_grad(fn, logit_dp.losses.contrastive(), 0.1, 2)
  ids = jnp.arange(6)
  bad = x.at[2, 0].set(jnp.nan)
  with pytest.raises(ValueError, match="non-finite"):
    grad_fn(params, bad, x_prime, record_ids=ids, group_key=KEY)
  jitted = jax.jit(lambda p, a, b, m, i: grad_fn(p, a, b, m, record_ids=i, group_key=KEY))
  dropped = jitted(params, bad, x_prime, jnp.ones(6, bool), ids)[1]
  masked = jitted(params, x, x_prime, jnp.arange(6) != 2, ids)[1]
  assert rel_err(dropped, masked) < 1e-6
  loss, grads, num = grad_fn.with_num_dropped(params, bad, x_prime, record_ids=ids, group_key=KEY)
  assert int(num) == 1 and np.isfinite(float(loss))
  nan_params = jax.tree_util.tree_map(lambda a: jnp.full_like(a, jnp.nan), params)
  loss, grads, num = grad_fn.with_num_dropped(nan_params, x, x_prime, record_ids=ids, group_key=KEY)
  assert int(num) == 6 and np.isnan(float(loss)) and np.all(flat(grads) == 0)


@pytest.mark.extended
def test_stats_are_the_norms_of_the_groups_with_a_valid_record(no_norm_allowance):
  fn, params, x, x_prime, views = make("linear", 11, seed=1, k=1)
  mask = np.ones(11, bool)
  mask[[2, 7]] = False
  ids = jnp.asarray([5, 90, 3, 41, 17, 8, 66, 12, 30, 2, 77])
  groups = np.asarray(logit_dp.baselines.assign_groups(ids, KEY, 4))
  used = np.unique(groups[mask])
  # The brute-force gradient of each group with a valid record (one jitted computation).
  group_grads = jax.jit(lambda p: [
      grad for _, grad in _group_gradients(_group_loss(fn, x, x_prime, views, 0.7), p, mask, groups)
  ])(params)
  norms = np.array([tree_norm(grad) for grad in group_grads])
  assert len(norms) == len(used)
  ordered = np.sort(norms)
  clip_norm = float((ordered[0] + ordered[1]) / 2)
  grad_fn = logit_dp.baselines.grouped_clipped_grad(fn, logit_dp.losses.contrastive(0.7), clip_norm,
                                                    4)
  loss, grads, stats = grad_fn.with_stats(params, x, x_prime, jnp.asarray(mask), record_ids=ids,
                                          group_key=KEY, extra_views=views)
  assert int(stats.num_valid) == 9 and int(stats.num_dropped) == 0
  assert int(stats.num_norms) == len(used) and int(stats.num_clipped) == len(used) - 1
  np.testing.assert_allclose(np.asarray(stats.quantiles),
                             np.quantile(norms, logit_dp.clip_methods.QUANTILE_LEVELS), rtol=1e-5)
  plain_loss, plain = grad_fn(params, x, x_prime, jnp.asarray(mask), record_ids=ids, group_key=KEY,
                              extra_views=views)
  np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6)
  assert rel_err(grads, plain) < 1e-6


@pytest.mark.slow  # test_nonfinite_records_raise_eagerly_and_are_dropped_under_jit jits by default
def test_jit_matches_eager():
  fn, params, x, x_prime, views = make("linear", 7, seed=12, k=1)
  grad_fn = logit_dp.baselines.grouped_clipped_grad(fn, logit_dp.losses.contrastive(), 0.3, 2)
  ids = jnp.arange(7) * 2
  eager = grad_fn(params, x, x_prime, record_ids=ids, group_key=KEY, extra_views=views)
  jitted = jax.jit(
      lambda p, a, b, i, key, v: grad_fn(p, a, b, record_ids=i, group_key=key, extra_views=v))(
          params, x, x_prime, ids, KEY, views)
  assert rel_err(jitted[1], eager[1]) < 1e-6


def test_bad_arguments_raise_value_error():
  fn, params, x, x_prime, views = make("linear", 5, seed=13, k=1)
  contrastive = logit_dp.losses.contrastive()
  for bad in (dict(loss=logit_dp.losses.spreadout()), dict(clip_norm=0.0),
              dict(clip_norm=float("inf")), dict(clip_norm=float("nan")), dict(num_groups=0),
              dict(num_groups=1.5), dict(num_groups=True), dict(microbatch_size=0)):
    args = dict(loss=contrastive, clip_norm=1.0, num_groups=2) | bad
    with pytest.raises(ValueError):
      logit_dp.baselines.grouped_clipped_grad(fn, args["loss"], args["clip_norm"],
                                              args["num_groups"],
                                              microbatch_size=bad.get("microbatch_size"))
  grad_fn = logit_dp.baselines.grouped_clipped_grad(fn, contrastive, 1.0, 2)
  ids = jnp.arange(5)
  call = lambda **kw: grad_fn(params, kw.pop("x", x), x_prime, kw.pop("mask", None),
                              **(dict(record_ids=ids, group_key=KEY) | kw))
  for kwargs, match in ((dict(record_ids=None),
                         "record_ids is required"), (dict(record_ids=ids[:4]), "shape"),
                        (dict(record_ids=ids.astype(jnp.float32)),
                         "integer"), (dict(record_ids=jnp.asarray([0, 1, 2, 2, 4])), "unique"),
                        (dict(record_ids=jnp.asarray([0, 1, -2, 3, 4])),
                         "≥ 0"), (dict(extra_views=views[:, 0]), "extra_views"),
                        (dict(extra_views=[views]), "extra_views"), (dict(extra_views=views[:3]),
                                                                     "extra_views"),
                        (dict(mask=jnp.ones(5)), "boolean"), (dict(x=x[:4]), "same number")):
    with pytest.raises(ValueError, match=match):
      call(**kwargs)
  with pytest.raises(ValueError):
    logit_dp.baselines.assign_groups(jnp.asarray([0.5, 1.0]), KEY, 2)
  with pytest.raises(ValueError):
    logit_dp.baselines.grouped_sensitivity(-1.0)
  assert logit_dp.baselines.grouped_sensitivity(0.25) == 0.5
  with pytest.raises(ValueError, match="dp_gcl"):
    audit.max_removal_ratio(fn, params, contrastive, 1.0, x, x_prime, method="dp_gcl")
  with pytest.raises(ValueError, match="dp_gcl"):
    audit.max_removal_ratio(fn, params, contrastive, 1.0, x, x_prime, num_groups=2)


# Two towers: an image MLP on float x and a bag-of-words text tower on token dicts x'; "shared"
# ends both in one projection (a leaf both towers depend on), "disjoint" gives each its own.
VOCAB, LENGTH = 7, 3


def two_towers(kind, n, seed, dropout=0.0):
  """(embed_images, embed_texts, params, x, texts); with dropout > 0 both towers take a key."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  params = {
      "w1": jax.random.normal(keys[0], (3, 5)), "b1": 0.1 * jax.random.normal(keys[1], (5,)),
      "emb": jax.random.normal(keys[2], (VOCAB, 5)), "head": jax.random.normal(keys[3], (5, 3))
  }
  if kind == "disjoint":
    params["text_head"] = jax.random.normal(keys[4], (5, 3))
  x = jax.random.normal(keys[5], (n, 3))
  lengths = 1 + jnp.arange(n) % LENGTH
  texts = {
      "ids": jax.random.randint(keys[6], (n, LENGTH), 0, VOCAB),
      "mask": jnp.arange(LENGTH)[None, :] < lengths[:, None]
  }

  def drop(h, key):
    if key is None:
      return h
    keep = jax.random.bernoulli(key, 1.0 - dropout, h.shape)
    return jnp.where(keep, h / (1.0 - dropout), 0.0)

  def embed_images(p, a, key=None):
    return drop(jnp.tanh(a @ p["w1"] + p["b1"]), key) @ p["head"]

  def embed_texts(p, t, key=None):
    e = p["emb"][t["ids"]]
    m = t["mask"][..., None].astype(e.dtype)
    mean = jnp.sum(e * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    return drop(jnp.tanh(mean), key) @ p["text_head" if kind == "disjoint" else "head"]

  if dropout:
    return embed_images, embed_texts, params, x, texts
  return (lambda p, a: embed_images(p, a), lambda p, t: embed_texts(p, t), params, x, texts)


def reference_two_towers(embed_u, embed_v, params, valid, groups, temperature, clip_norm):
  """The brute-force group losses and clipped sum with û_i = embed_u(p, i), v̂_i = embed_v(p, i)
  (unnormalised embeddings of record i alone), every group in its own jax.grad."""
  valid, groups = np.asarray(valid), np.asarray(groups)
  total_loss, total = 0.0, jax.tree_util.tree_map(jnp.zeros_like, params)
  for g in np.unique(groups[valid]):
    members = [i for i in range(len(valid)) if valid[i] and groups[i] == g]

    def group_loss(p, members=members):
      u = [_unit(embed_u(p, i)) for i in members]
      v = [_unit(embed_v(p, i)) for i in members]
      value = 0.0
      for a in range(len(members)):
        logits = jnp.stack([jnp.dot(u[a], v[b]) for b in range(len(members))]) / temperature
        value += jax.nn.logsumexp(logits) - logits[a]
      return value

    # Compiled as a whole (one compilation per group, not one per operation).
    value, grad = jax.jit(jax.value_and_grad(group_loss))(params)
    norm = jnp.sqrt(sum(jnp.sum(leaf ** 2) for leaf in jax.tree_util.tree_leaves(grad)))
    factor = jnp.minimum(1.0, clip_norm / norm)
    total_loss += value
    total = jax.tree_util.tree_map(lambda t, gr, f=factor: t + f * gr, total, grad)
  return total_loss, total


def _row(tree, i):
  return jax.tree_util.tree_map(lambda a: a[i:i + 1], tree)


# Shared towers in microbatches of 4 run by default in
# test_stochastic_two_towers_match_the_brute_force_reference_in_float64.
@pytest.mark.parametrize("kind,microbatch,clip_norm", [
    pytest.param("shared", 4, 0.05, marks=pytest.mark.extended),
    ("disjoint", None, 0.05),
    pytest.param("shared", None, 1e3, marks=pytest.mark.slow),
])
def test_two_towers_match_the_brute_force_reference_in_float64(no_norm_allowance, kind, microbatch,
                                                               clip_norm):
  """x by the image tower, x' (token dicts) by the text tower, one params pytree: ḡ and ℒ equal
  the float64 brute force (each group's loss of its members' two towers, clipped, summed)."""
  with jax.enable_x64(True):
    f, f_prime, params, x, texts = two_towers(kind, 11, seed=1)
    params, x = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), (params, x))
    mask = np.ones(11, bool)
    mask[[2, 7]] = False
    ids = jnp.asarray([5, 90, 3, 41, 17, 8, 66, 12, 30, 2, 77])
    groups = logit_dp.baselines.assign_groups(ids, KEY, 3)
    assert len(np.unique(np.asarray(groups)[mask])) == 3
    ref_loss, ref = reference_two_towers(lambda p, i: f(p, x[i:i + 1])[0],
                                         lambda p, i: f_prime(p, _row(texts, i))[0], params, mask,
                                         groups, 0.7, clip_norm)
    grad_fn = logit_dp.baselines.grouped_clipped_grad(f, logit_dp.losses.contrastive(0.7),
                                                      clip_norm, 3, microbatch_size=microbatch,
                                                      positive_embed_fn=f_prime)
    loss, got = grad_fn(params, x, texts, jnp.asarray(mask), record_ids=ids, group_key=KEY)
    assert flat(got).dtype == np.float64 and rel_err(got, ref) < 1e-10
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-12)
    if kind == "disjoint":  # the text tower's own head gets a gradient, and it is clipped
      assert np.abs(flat(got["text_head"])).max() > 0


def test_stochastic_two_towers_match_the_brute_force_reference_in_float64(no_norm_allowance):
  """Dropout in both towers: record r's image is embedded with fold_in(fold_in(key, 0), r), its
  text with fold_in(fold_in(key, 1), r), as in clipped_grad; in microbatches too."""
  with jax.enable_x64(True):
    f, f_prime, params, x, texts = two_towers("shared", 9, seed=2, dropout=0.5)
    params, x = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), (params, x))
    key = jax.random.key(11)
    row_key = lambda view, i: jax.random.fold_in(jax.random.fold_in(key, view), i)
    ids = jnp.arange(9) * 7
    groups = logit_dp.baselines.assign_groups(ids, KEY, 2)
    ref_loss, ref = reference_two_towers(lambda p, i: f(p, x[i:i + 1], row_key(0, i))[0],
                                         lambda p, i: f_prime(p, _row(texts, i), row_key(1, i))[0],
                                         params, np.ones(9, bool), groups, 0.5, 0.05)
    loss_fn = logit_dp.losses.contrastive(0.5)
    for microbatch in (None, 4):
      grad_fn = logit_dp.baselines.grouped_clipped_grad(f, loss_fn, 0.05, 2,
                                                        positive_embed_fn=f_prime, stochastic=True,
                                                        microbatch_size=microbatch)
      loss, got = grad_fn(params, x, texts, record_ids=ids, group_key=KEY, key=key)
      assert rel_err(got, ref) < 1e-10, microbatch
      np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-12)


def _float_towers(kind, n, seed):
  """Two towers on float inputs (the attacks move x and x'): an MLP and a linear tower,
  sharing the MLP's last layer ("shared") or not ("disjoint")."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  params = {
      "w1": jax.random.normal(keys[0], (3, 5)), "w2": jax.random.normal(keys[1], (5, 3)),
      "v": jax.random.normal(keys[2], (4, 5 if kind == "shared" else 3))
  }
  f = lambda p, a: jnp.tanh(a @ p["w1"]) @ p["w2"]
  f_prime = ((lambda p, b: jnp.tanh(b @ p["v"]) @ p["w2"]) if kind == "shared" else
             (lambda p, b: b @ p["v"]))
  return f, f_prime, params, jax.random.normal(keys[3], (n, 3)), jax.random.normal(keys[4], (n, 4))


@pytest.mark.parametrize("kind,num_groups,clip_norm",
                         [("shared", 2, 1e-3),
                          pytest.param("disjoint", 3, 0.3, marks=pytest.mark.extended)])
def test_two_tower_removal_audit_stays_within_2b(kind, num_groups, clip_norm):
  """Removing each record in turn moves ḡ by at most 2B, and by more than B (the bound is not
  B: a group's clipped gradient is replaced); a random search over batches stays within 2B."""
  f, f_prime, params, x, x_prime = _float_towers(kind, 8, seed=8)
  loss = logit_dp.losses.contrastive(0.5)
  result = audit.max_removal_ratio(f, params, loss, clip_norm, x, x_prime, method="dp_gcl",
                                   num_groups=num_groups, positive_embed_fn=f_prime)
  assert result.bound == result.bound_sup == logit_dp.baselines.grouped_sensitivity(clip_norm)
  assert 0.5 < result.ratio <= 1 + TOL
  searched = audit.search_worst_case(f, params, loss, clip_norm, x, x_prime,
                                     key=jax.random.PRNGKey(2), num_restarts=6, num_steps=0,
                                     method="dp_gcl", num_groups=num_groups,
                                     positive_embed_fn=f_prime)
  assert searched.ratio <= 1 + TOL


def test_two_tower_removal_audit_with_token_inputs_and_dropout():
  """Pytree x' (token dicts) and a stochastic model, its key held fixed: within 2B."""
  f, f_prime, params, x, texts = two_towers("shared", 8, seed=3, dropout=0.3)
  result = audit.max_removal_ratio(f, params, logit_dp.losses.contrastive(0.5), 1e-3, x, texts,
                                   method="dp_gcl", num_groups=2, positive_embed_fn=f_prime,
                                   model_key=jax.random.key(4))
  assert 0.5 < result.ratio <= 1 + TOL


@pytest.mark.slow
def test_two_tower_gradient_ascent_attack_never_exceeds_2b():
  f, f_prime, params, x, x_prime = _float_towers("shared", 8, seed=1)
  _assert_attack_approaches_2b(f, params, x, x_prime, 4, positive_embed_fn=f_prime)


@pytest.mark.extended
def test_two_tower_bad_arguments_raise_value_error():
  f, f_prime, params, x, texts = two_towers("shared", 5, seed=13)
  contrastive = logit_dp.losses.contrastive()
  with pytest.raises(ValueError, match="positive_embed_fn"):
    logit_dp.baselines.grouped_clipped_grad(f, contrastive, 1.0, 2, positive_embed_fn="text")
  grad_fn = logit_dp.baselines.grouped_clipped_grad(f, contrastive, 1.0, 2,
                                                    positive_embed_fn=f_prime)
  with pytest.raises(ValueError, match="extra_views"):
    grad_fn(params, x, texts, record_ids=jnp.arange(5), group_key=KEY, extra_views=x[:, None])
  with pytest.raises(ValueError, match="same number"):
    grad_fn(params, x[:4], texts, record_ids=jnp.arange(4), group_key=KEY)
  with pytest.raises(ValueError, match="extra_views"):
    audit.max_removal_ratio(f, params, contrastive, 1.0, x, texts, method="dp_gcl", num_groups=2,
                            positive_embed_fn=f_prime, extra_views_fn=lambda a, b: a[:, None])
