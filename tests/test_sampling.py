"""logit_dp.sampling: Poisson batches (distribution, padding, overflow), the
shuffled baseline batcher, and padded batches through clipped_grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import logit_dp
from logit_dp import sampling


def _draws(num_records, q, max_batch_size, num_draws, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), num_draws)
  batches = jax.vmap(lambda k: sampling.poisson_batch(k, num_records, q, max_batch_size))(keys)
  return jax.tree_util.tree_map(np.asarray, batches)


def test_poisson_batch_structure():
  n, q, b = 200, 0.1, 64
  batch = sampling.poisson_batch(jax.random.PRNGKey(3), n, q, b)
  assert batch.indices.shape == (b,) and batch.indices.dtype == jnp.int32
  assert batch.mask.shape == (b,) and batch.mask.dtype == jnp.bool_
  k = int(batch.batch_size)
  assert k == int(batch.sampled_size) == int(batch.mask.sum()) and not bool(batch.overflow)
  assert np.all(np.asarray(batch.mask[:k])) and not np.any(np.asarray(batch.mask[k:]))
  idx = np.asarray(batch.indices)
  assert np.all(np.diff(idx[:k]) > 0)  # distinct, increasing
  assert idx.min() >= 0 and idx[:k].max() < n
  assert np.all(idx[k:] == 0)  # padding points at record 0, masked out
  again = sampling.poisson_batch(jax.random.PRNGKey(3), n, q, b)
  np.testing.assert_array_equal(idx, np.asarray(again.indices))
  # Full batch: q = 1 takes every record.
  full = sampling.poisson_batch(jax.random.PRNGKey(0), 10, 1.0, 12)
  np.testing.assert_array_equal(np.asarray(full.indices[:10]), np.arange(10))
  assert int(full.batch_size) == 10


def test_batch_sizes_are_binomial_and_inclusion_is_uniform():
  """Statistical test (fixed seed): over 4,000 batches, sizes follow
  Binomial(N, q) (chi-square goodness of fit) and every record is included
  with frequency q (chi-square homogeneity + per-record z-scores)."""
  n, q, draws = 400, 0.05, 4000
  out = _draws(n, q, 80, draws, seed=1)
  assert not out.overflow.any()
  sizes = out.sampled_size
  np.testing.assert_array_equal(sizes, out.mask.sum(axis=1))

  # Goodness of fit of the size distribution, bins with expected count ≥ 5.
  dist = stats.binom(n, q)
  edges = [0]
  k = 0
  while k < n:
    k += 1
    if dist.cdf(k - 1) - dist.cdf(edges[-1] - 1) >= 5 / draws and dist.sf(k - 1) >= 5 / draws:
      edges.append(k)
  edges[-1] = n + 1  # last bin takes the upper tail
  probs = np.diff([dist.cdf(e - 1) for e in edges])
  probs[-1] += dist.sf(edges[-1] - 1)
  observed = np.histogram(sizes, bins=edges)[0]
  chi2, p_value = stats.chisquare(observed, probs / probs.sum() * draws)
  assert p_value > 1e-3, (chi2, p_value)
  assert abs(sizes.mean() - n * q) < 4 * np.sqrt(n * q * (1 - q) / draws)

  # Inclusion frequency per record: Binomial(draws, q) each, all equal.
  counts = np.bincount(out.indices[out.mask], minlength=n)
  z = (counts - draws * q) / np.sqrt(draws * q * (1 - q))
  assert np.abs(z).max() < 4.5  # Bonferroni over 400 records at ~1e-5 each
  p_uniform = stats.chi2.sf(np.sum(z ** 2), df=n)
  assert p_uniform > 1e-3, p_uniform


def test_overflow_error_and_truncate():
  n, q, b = 100, 0.5, 40
  strict = sampling.PoissonSampler(n, q, max_batch_size=b, seed=0)
  lenient = sampling.PoissonSampler(n, q, max_batch_size=b, seed=0, overflow="truncate")
  raised = 0
  for step in range(5):
    batch = lenient(step)
    assert int(batch.batch_size) == min(int(batch.sampled_size), b)
    if bool(batch.overflow):
      assert int(batch.mask.sum()) == b
      with pytest.raises(sampling.BatchOverflowError, match="max_batch_size"):
        strict(step)
      raised += 1
    else:
      np.testing.assert_array_equal(np.asarray(strict(step).indices), np.asarray(batch.indices))
  assert raised >= 3  # Binomial(100, 0.5) > 40 with probability ≈ 0.98


def test_max_batch_size_and_overflow_probability():
  n, q = 50_000, 0.02
  b = sampling.max_batch_size_for(n, q)
  p = sampling.overflow_probability(n, q, b)
  assert p <= sampling.DEFAULT_OVERFLOW_PROBABILITY
  assert sampling.overflow_probability(n, q, b - 1) > sampling.DEFAULT_OVERFLOW_PROBABILITY
  assert p == pytest.approx(stats.binom.sf(b, n + 1, q))
  assert 1000 + 6 * 31 < b < 1000 + 8 * 31  # ≈ 7σ above the mean of 1000
  assert sampling.max_batch_size_for(n, q, multiple_of=64) % 64 == 0
  assert sampling.max_batch_size_for(10, 1.0) == 11  # q = 1: never overflows
  assert sampling.overflow_probability(10, 1.0, 11) == 0.0
  # The extra δ: (1 + e^ε)(1 − (1 − p)^T) ≤ (1 + e^ε)·T·p, and 0 when p = 0.
  extra = sampling.overflow_delta(n, q, b, steps=1000, epsilon=5.0)
  assert extra == pytest.approx((1 + np.exp(5.0)) * 1000 * p, rel=1e-6)
  assert extra < 2e-7
  assert sampling.overflow_delta(10, 1.0, 11, steps=1000, epsilon=5.0) == 0.0
  assert sampling.overflow_delta(n, q, 1000, 10, 1.0) > sampling.overflow_delta(n, q, 1100, 10, 1.0)
  sampler = sampling.PoissonSampler(n, q)
  assert sampler.max_batch_size == b and sampler.step_overflow_probability == p
  assert sampler.expected_batch_size == pytest.approx(1000)


def test_inclusion_probability_never_exceeds_q():
  for q in (1e-6, 0.02, 1 / 3, 0.5, 1 - 1e-12):
    p = sampling.inclusion_threshold(q) / 2 ** 32
    assert q - 2 ** -32 < p <= q
  assert sampling.inclusion_threshold(1.0) is None


def test_sampler_is_a_function_of_seed_and_step():
  """A restarted run draws exactly the batches of an uninterrupted one."""
  a = sampling.PoissonSampler(300, 0.1, seed=7)
  b = sampling.PoissonSampler(300, 0.1, seed=7)
  for step in (0, 5, 123):
    np.testing.assert_array_equal(np.asarray(a(step).indices), np.asarray(b(step).indices))
  assert not np.array_equal(np.asarray(a(0).indices), np.asarray(a(1).indices))
  c = sampling.PoissonSampler(300, 0.1, seed=8)
  assert not np.array_equal(np.asarray(a(0).indices), np.asarray(c(0).indices))


@pytest.mark.parametrize("kwargs", [
    dict(num_records=0, sampling_rate=0.1),
    dict(num_records=10, sampling_rate=0.0),
    dict(num_records=10, sampling_rate=1.5),
    dict(num_records=10, sampling_rate=0.1, max_batch_size=0),
    dict(num_records=10, sampling_rate=0.1, overflow="drop"),
    dict(num_records=10, sampling_rate=0.1, seed=-1),
])
def test_sampler_rejects_bad_input(kwargs):
  with pytest.raises(ValueError):
    sampling.PoissonSampler(**kwargs)


def test_shuffled_batcher_visits_every_record_once_per_epoch():
  batcher = sampling.ShuffledBatcher(num_records=23, batch_size=5, seed=3)
  assert batcher.num_batches() == 5
  epochs = []
  for e in range(3):
    seen = []
    for idx, mask in batcher.epoch(e):
      assert idx.shape == mask.shape == (5,)
      seen.extend(idx[mask].tolist())
    assert sorted(seen) == list(range(23))  # exactly once
    epochs.append(seen)
  assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
  assert [i.tolist() for i, _ in batcher.epoch(1)] == [i.tolist() for i, _ in batcher.epoch(1)]
  dropped = sampling.ShuffledBatcher(num_records=23, batch_size=5, seed=3, drop_remainder=True)
  batches = list(dropped.epoch(0))
  assert len(batches) == 4 and all(m.all() for _, m in batches)
  seen = np.concatenate([i for i, _ in batches])
  assert len(set(seen.tolist())) == 20


@pytest.mark.slow  # padding masks through clipped_grad: test_clipping's mask test by default
def test_padded_poisson_batch_through_clipped_grad():
  """Padded rows (index 0, mask False) contribute nothing: (ℒ, ḡ) of the padded
  batch equal those of the valid rows alone."""
  from conftest import make_model  # pylint: disable=g-import-not-at-top
  embed_fn, params, x_all, xp_all = make_model("mlp", n=40)
  loss = logit_dp.losses.contrastive(temperature=0.5)
  grad_fn = logit_dp.clipped_grad(embed_fn, loss, clip_norm=1.0, method="ghost")
  batch = sampling.poisson_batch(jax.random.PRNGKey(2), 40, 0.2, 16)
  k = int(batch.batch_size)
  assert 2 <= k < 16
  idx = np.asarray(batch.indices)
  value, grads = jax.jit(grad_fn)(params, x_all[idx], xp_all[idx], batch.mask)
  ref_value, ref_grads = grad_fn(params, x_all[idx[:k]], xp_all[idx[:k]])
  np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
  for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
