"""Exact clip norms within 1.10× of their float64 truth where the float32 allowance bites.

A clip norm more than `pair_terms.FLAG_RATIO` times the lower end of its float error interval
is formed again as a vector in float64 (`pair_terms.refine_flagged`). The stresses: two records
of a batch near-identical (their off-diagonal pairs nearly cancel), a tiny clip norm on
ordinary views, near-identical positives formed in float32 first, and "projected" with
references spanning every pair gradient (exact in exact arithmetic). The truth: jax.grad of
each Z_ij in float64 (`helpers.float64_clipped_reference`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from conftest import SmallConv
from helpers import flat
from helpers import float64_clipped_reference
from helpers import rel_err
from logit_dp._src import pair_terms
from logit_dp.clip_methods import Projected

LOSS = logit_dp.losses.contrastive(temperature=1.0)
TIGHT = pair_terms.FLAG_RATIO


def _duplicates(n=8, dim=5, seed=0):
  """Records 0 and 1 near-identical (x_1 = x_0 + 1e-3·noise), views x' = x + 1e-2·noise: the
  pairs (0, 1) and (1, 0) nearly cancel, like the positives."""
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  model = SmallConv(dim=dim)
  x = jax.random.uniform(k1, (n, 8, 8, 3))
  x = x.at[1].set(x[0] + 1e-3 * jax.random.normal(k4, x.shape[1:]))
  x_prime = x + 1e-2 * jax.random.normal(k2, x.shape)
  return model.apply, model.init(k3, x[:1]), x, x_prime


def _truth(embed_fn, params, x, x_prime, clip_norm=1.0):
  with jax.enable_x64(True):
    return float64_clipped_reference(embed_fn, LOSS, params, x, x_prime, clip_norm)


def _norms(embed_fn, params, x, x_prime, method="ghost", **kwargs):
  fresh = lambda p, xs: embed_fn(p, xs)  # nothing compiled is reused across the tests
  return np.asarray(
      logit_dp.clip_methods.pair_grad_norms(fresh, params, x, x_prime, method, **kwargs),
      np.float64)


def _unrefined(monkeypatch):
  """The library without the recomputation of flagged pairs (the negative control)."""
  monkeypatch.setattr(pair_terms, "refine_flagged", lambda norms, *args, **kwargs: norms)


@pytest.fixture(scope="module")
def duplicates_truth():
  problem = _duplicates()
  return problem, _truth(*problem)[0]


@pytest.fixture(scope="module")
def duplicates_norms(duplicates_truth):
  """The library's ghost norms of the duplicates as they are (computed once: the tests that
  patch the library call `_norms` themselves)."""
  problem, _ = duplicates_truth
  return _norms(*problem)


@pytest.mark.parametrize("float64_positive_pairs", [True, False])
def test_near_duplicate_records_get_norms_within_10_percent_of_the_truth(
    duplicates_truth, duplicates_norms, float64_positive_pairs):
  """Every pair, on and off the diagonal: truth ≤ norm ≤ 1.10·truth, the positives formed in
  float64 or in float32 first (then the flagged ones again in float64)."""
  problem, truth = duplicates_truth
  got = (duplicates_norms
         if float64_positive_pairs else _norms(*problem, float64_positive_pairs=False))
  assert np.all(got >= truth * (1 - 2.0 ** -23)), np.min(got / truth)
  assert np.all(got <= TIGHT * truth), np.max(got / truth)


def test_without_the_recomputation_near_duplicates_are_over_clipped(duplicates_truth, monkeypatch):
  """Negative control: the Gram allowance alone puts the cancelling off-diagonal pairs (and
  float32-formed positives) far above their truth."""
  problem, truth = duplicates_truth
  _unrefined(monkeypatch)
  off = ~np.eye(truth.shape[0], dtype=bool)
  got = _norms(*problem)
  assert np.max(got[off] / truth[off]) > 2 * TIGHT
  assert np.all(got >= truth * (1 - 2.0 ** -23))  # sound, only loose
  positives = np.diag(_norms(*problem, float64_positive_pairs=False))
  assert np.max(positives / np.diag(truth)) > 2 * TIGHT


def test_blocks_and_the_ring_recompute_the_same_pairs(duplicates_truth, monkeypatch):
  """Blocked ghost (2 × 2 blocks of pairs) flags and recomputes within its blocks: the same
  bounds as one block."""
  from logit_dp._src import chunking  # pylint: disable=g-import-not-at-top
  problem, truth = duplicates_truth
  monkeypatch.setattr(chunking, "ghost_block_sizes", lambda n, *args, **kwargs: (4, 4))
  got = _norms(*problem, logit_dp.clip_methods.Ghost(memory_budget=1 << 40))
  assert np.all(got >= truth * (1 - 2.0 ** -23)), np.min(got / truth)
  assert np.all(got <= TIGHT * truth), np.max(got / truth)


def test_the_gradient_alone_is_that_of_the_tightened_norms(duplicates_truth, duplicates_norms):
  """ḡ without statistics leaves the norms at or below B as they are (their clip factor is 1
  whatever their exact value): it is the clipped sum of the float64 pair gradients clipped by
  the tightened norms (`pair_grad_norms`), B the median norm."""
  problem, truth = duplicates_truth
  embed_fn, params, x, x_prime = problem
  tight = duplicates_norms
  clip_norm = float(np.median(truth))
  _, grads = logit_dp.clipped_grad(lambda p, xs: embed_fn(p, xs), LOSS, clip_norm,
                                   "ghost")(params, x, x_prime)
  with jax.enable_x64(True):
    _, reference = float64_clipped_reference(embed_fn, LOSS, params, x, x_prime, clip_norm,
                                             clip_by=tight)
  assert rel_err(grads, reference) <= 5e-5


def test_the_gradient_alone_forms_no_pair_at_or_below_b(duplicates_truth, monkeypatch):
  """Counted as they run: with B above every norm ḡ forms no pair as a vector; at a tiny B it
  forms the positives and the near-duplicates' pairs (the control)."""
  problem, truth = duplicates_truth
  embed_fn, params, x, x_prime = problem
  formed = []
  original = pair_terms.factor_positive_norms

  def counted(*args):
    values = original(*args)
    jax.debug.callback(lambda v: formed.append(v.shape[0]), values)
    return values

  monkeypatch.setattr(pair_terms, "factor_positive_norms", counted)
  for clip_norm, expect_formed in ((2.0 * np.max(truth) * TIGHT, False), (1e-5, True)):
    formed.clear()
    grad_fn = logit_dp.clipped_grad(lambda p, xs: embed_fn(p, xs), LOSS, clip_norm, "ghost")
    jax.block_until_ready(grad_fn(params, x, x_prime))
    jax.effects_barrier()
    assert bool(formed) == expect_formed, (clip_norm, formed)


@pytest.fixture(scope="module")
def tiny_clip_norm_case():
  """Ordinary views (x' = x + 0.1·noise) of n = 32 pairs, d = 4, B = 1e-5: every pair clipped,
  so each clip factor is B/norm and an over-estimated norm shrinks its pair's weight."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
  model = SmallConv(dim=4)
  x = jax.random.uniform(k1, (32, 8, 8, 3))
  x_prime = x + 0.1 * jax.random.normal(k2, x.shape)
  params = model.init(k3, x[:1])
  truth, reference = _truth(model.apply, params, x, x_prime, clip_norm=1e-5)
  return (model.apply, params, x, x_prime), truth, reference


def test_tiny_clip_norm_norms_and_gradient_follow_the_float64_truth(tiny_clip_norm_case):
  """Norms within [1, 1.10]× the truth, and ḡ within what they move the clip factors by:
  |B/n − B/n*|·‖g‖ ≤ B·(n − n*)/n* per pair, plus float32 rounding of ḡ."""
  problem, truth, reference = tiny_clip_norm_case
  got = _norms(*problem)
  assert np.all(got >= truth * (1 - 2.0 ** -23)), np.min(got / truth)
  assert np.all(got <= TIGHT * truth), np.max(got / truth)
  fresh = lambda p, xs: problem[0](p, xs)
  _, grads = logit_dp.clipped_grad(fresh, LOSS, 1e-5, "ghost")(*problem[1:])
  with jax.enable_x64(True):
    p64, x64, xp64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), problem[1:])

    @jax.jit
    def weights(p64, x64, xp64):
      z = logit_dp.losses.cosine_similarity(problem[0](p64, x64), problem[0](p64, xp64))
      return jax.grad(LOSS)(z, jnp.ones((32,), bool))

    tau = np.abs(np.asarray(weights(p64, x64, xp64)))
  moved = np.sum(tau * 1e-5 * np.maximum(got - truth, 0.0) / truth)
  assert rel_err(grads, reference) <= moved / np.linalg.norm(flat(reference)) + 5e-5


@pytest.mark.slow  # a second float64 truth of the conv net; the default run has the duplicates
def test_projected_with_spanning_references_is_within_10_percent():
  """References holding every pair gradient (here the batch's own inputs): the bound is the
  exact norm in exact arithmetic, and its float32 values lie within [1, 1.10]× the truth."""
  embed_fn, params, x, x_prime = _duplicates(dim=4)
  truth, _ = _truth(embed_fn, params, x, x_prime)
  method = Projected(reference_inputs=jnp.concatenate([x, x_prime]), rank=2 * 8 * 4)
  got = _norms(embed_fn, params, x, x_prime, method)
  assert np.all(got >= truth * (1 - 2.0 ** -23)), np.min(got / truth)
  assert np.all(got <= TIGHT * truth), np.max(got / truth)


def test_each_norm_depends_on_its_own_pair_only(duplicates_truth, duplicates_norms):
  """The flagged pairs are all formed again, whatever the others: dropping records leaves the
  norms of the remaining pairs as they were (the sensitivity needs each clip factor to be a
  function of its pair alone)."""
  problem, _ = duplicates_truth
  embed_fn, params, x, x_prime = problem
  full = duplicates_norms
  keep = np.array([0, 1, 2, 4, 7])
  part = _norms(embed_fn, params, x[keep], x_prime[keep])
  # float32 rounding differs with the batch's shape (1e-5 here); a pair tightened in one batch
  # and not in the other would differ by up to its allowance (368× on these records).
  np.testing.assert_allclose(part, full[np.ix_(keep, keep)], rtol=1e-4)


@pytest.mark.extended
def test_the_gradient_through_recomputed_norms_is_finite(duplicates_truth):
  """Reverse mode through clipped_grad with flagged pairs (the audits' gradient ascent): the
  recomputed norms enter as constants."""
  problem, _ = duplicates_truth
  embed_fn, params, x, x_prime = problem
  grad_fn = logit_dp.clipped_grad(lambda p, xs: embed_fn(p, xs), LOSS, 1e-5, "ghost")
  objective = lambda xp: sum(
      jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grad_fn(params, x, xp)[1]))
  assert np.all(np.isfinite(np.asarray(jax.grad(objective)(x_prime))))


def test_a_forced_pair_takes_its_recomputed_value_and_a_flagged_one_the_smaller_bound():
  """refine_flagged against its contract, computed by hand: a flagged pair keeps min(norm,
  recomputed), a forced one its recomputed value (even above the norm it had: the positives
  without an allowance are computed values, not bounds), a non-finite one stays dropped."""
  norms = jnp.array([[1.0, 5.0, 2.0], [jnp.nan, 3.0, 4.0]])
  lower = jnp.array([[1.0, 1.0, 2.0], [1.0, 3.0, 1.0]])  # flags (0, 1) and (1, 2) by ratio
  forced = jnp.array([[True, False, False], [True, True, False]])
  recomputed = jnp.array([9.0, 2.0, 7.0, 8.0, 0.5, 6.0])  # by flat pair index

  def recompute(operands, index):
    return operands[index]

  got = np.asarray(
      pair_terms.refine_flagged(norms, lower, recompute, recomputed, per_pass=2, forced=forced))
  want = np.array([[9.0, 2.0, 2.0], [np.nan, 0.5, 4.0]])
  np.testing.assert_array_equal(got, want)
  # Without the forced pairs only the flagged ones are tightened.
  got = np.asarray(pair_terms.refine_flagged(norms, lower, recompute, recomputed, per_pass=2))
  np.testing.assert_array_equal(got, np.array([[1.0, 2.0, 2.0], [np.nan, 3.0, 4.0]]))


def test_positive_pairs_without_the_allowance_are_their_vectors_not_their_gram_form(
    duplicates_truth):
  """pair_grad_norms(float_allowance=False) reports the positives formed as vectors, as its
  docstring promises ("exact on it"): near-identical views cancel in the Gram form, which the
  negative control (no refinement) shows losing them."""
  (embed_fn, params, x, x_prime), truth = duplicates_truth
  diagonal = np.eye(truth.shape[0], dtype=bool)
  got = _norms(embed_fn, params, x, x_prime, float_allowance=False)
  np.testing.assert_allclose(got[diagonal], truth[diagonal], rtol=1e-3)


def test_positive_pairs_without_the_allowance_negative_control(duplicates_truth, monkeypatch):
  (embed_fn, params, x, x_prime), truth = duplicates_truth
  _unrefined(monkeypatch)
  diagonal = np.eye(truth.shape[0], dtype=bool)
  got = _norms(embed_fn, params, x, x_prime, float_allowance=False)
  assert np.max(np.abs(got[diagonal] / truth[diagonal] - 1.0)) > 1e-2
