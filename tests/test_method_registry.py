"""A clip method defined outside the package: one class and one `register` line, then usable by
name or as an object in `clipped_grad` and `make_private`."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from conftest import make_model
from logit_dp import clip_methods
from logit_dp._src import methods as methods_lib

LOSS = logit_dp.losses.contrastive(temperature=0.5)
N = 6
# A relative margin far above float32 rounding, so that the norms are upper bounds.
MARGIN = 1e-3


@dataclasses.dataclass(frozen=True)
class ExactSlow(clip_methods.ClipMethod):
  """Every pair gradient g_ij = ∇_w Z_ij by its own jax.grad, all n² at once, normed with a
  relative margin: exact (up to the margin) and slow."""
  name: ClassVar[str] = "exact-slow"

  def pair_norms_with_factors(self, batch, allowance):
    x_prime = batch.c.gather(batch.x_prime)

    def pair_norm(i, j):
      def z(params):
        u = batch.normalized_embedding(params, x[i][None])
        v = batch.normalized_embedding(params, x_prime[j][None], positive=True)
        return jnp.sum(u * v)

      grads = jax.grad(z)(batch.params)
      return jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))

    x = batch.x
    rows, cols = jnp.meshgrid(jnp.arange(x.shape[0]), jnp.arange(x_prime.shape[0]), indexing="ij")
    norms = jax.vmap(jax.vmap(pair_norm))(rows, cols)
    return norms * (1.0 + allowance * MARGIN), None


jax.tree_util.register_dataclass(ExactSlow, data_fields=[], meta_fields=[])


@pytest.fixture(name="registered")
def _registered(monkeypatch):
  """ExactSlow registered for one test (the registry as it was afterwards)."""
  monkeypatch.setattr(methods_lib, "REGISTRY", dict(methods_lib.REGISTRY))
  assert clip_methods.register(ExactSlow) is ExactSlow
  return ExactSlow


def _flat(tree) -> np.ndarray:
  return np.concatenate(
      [np.ravel(np.asarray(a, np.float64)) for a in jax.tree_util.tree_leaves(tree)])


def _brute_force(embed_fn, params, x, x_prime, clip_norm):
  """ḡ = Σ_ij τ_ij·min(1, B/‖g_ij‖)·g_ij from jax.grad of ℒ and of each Z_ij, in float64 sums,
  with the norms ‖g_ij‖·(1 + MARGIN) ExactSlow clips by."""
  def z(p):
    return logit_dp.losses.cosine_similarity(embed_fn(p, x), embed_fn(p, x_prime))

  tau = np.asarray(jax.jit(lambda p: jax.grad(lambda zz: LOSS(zz))(z(p)))(params), np.float64)
  # One compilation for every pair (i and j traced), not one per operation and pair.
  pair_grad = jax.jit(lambda p, i, j: jax.grad(lambda p: z(p)[i, j])(p))
  total = 0.0
  for i in range(N):
    for j in range(N):
      g = _flat(pair_grad(params, i, j))
      norm = np.linalg.norm(g) * (1.0 + MARGIN)
      total = total + tau[i, j] * min(1.0, clip_norm / norm) * g
  return total


def test_a_registered_method_resolves_by_name_and_clips_like_the_brute_force_sum(registered):
  assert "exact-slow" in clip_methods.names()
  assert clip_methods.resolve("exact-slow") == registered()
  embed_fn, params, x, x_prime = make_model("mlp", n=N)
  exact = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "exact-slow"))
  reference = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize"))
  np.testing.assert_allclose(exact, reference * (1 + MARGIN), rtol=1e-4)
  clip_norm = float(np.median(exact))
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm, "exact-slow")
  assert isinstance(grad_fn.clip_method, registered) and grad_fn.method == "exact-slow"
  _, grads = grad_fn(params, x, x_prime)
  want = _brute_force(embed_fn, params, x, x_prime, clip_norm)
  np.testing.assert_allclose(_flat(grads), want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
  # Its statistics come from the same norms.
  _, _, stats = grad_fn.with_stats(params, x, x_prime)
  assert int(stats.num_clipped) == int(np.sum(exact > clip_norm))


@pytest.mark.extended  # training end to end; resolution and clipping are tested above
@pytest.mark.parametrize("by", ["name", "object"])
def test_make_private_trains_with_a_registered_method(registered, by):
  embed_fn, params, _, _ = make_model("mlp", n=N)
  num_records = 60
  data = jax.random.normal(jax.random.PRNGKey(3), (num_records, 7))
  data_prime = data + 0.1 * jax.random.normal(jax.random.PRNGKey(4), data.shape)
  private = logit_dp.make_private(embed_fn, LOSS, 0.5, target_epsilon=8.0, target_delta=1e-2,
                                  num_records=num_records, expected_batch_size=N,
                                  optimizer=optax.sgd(0.05), steps=3,
                                  method="exact-slow" if by == "name" else registered(),
                                  noise_key=jax.random.key(0), sampler_seed=0)
  assert private.method == "exact-slow" and isinstance(private.grad_fn.clip_method, registered)
  assert private.sensitivity == logit_dp.sensitivity(LOSS, 0.5, batch_size=None)
  opt_state = private.optimizer.init(params)
  start = params
  for batch in private.batches():
    _, grads = private.grad_fn(params, data[batch.indices], data_prime[batch.indices], batch.mask)
    updates, opt_state = private.optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  assert private.ledger.steps == 3
  moved = _flat(params) - _flat(start)
  assert np.all(np.isfinite(moved)) and np.linalg.norm(moved) > 0


def test_register_refuses_what_is_not_a_new_clip_method(registered):
  assert clip_methods.register(registered) is registered  # again: nothing changes

  @dataclasses.dataclass(frozen=True)
  class Other(registered):
    pass

  with pytest.raises(ValueError, match="already registered as 'exact-slow'"):
    clip_methods.register(Other)

  @dataclasses.dataclass(frozen=True)
  class Naive(registered):
    name: ClassVar[str] = "naive"

  with pytest.raises(ValueError, match="another mechanism"):
    clip_methods.register(Naive)
  with pytest.raises(TypeError, match="ClipMethod subclass"):
    clip_methods.register(dict)
  with pytest.raises(ValueError, match="method must be"):
    logit_dp.make_private(lambda p, x: x, LOSS, 0.5, target_epsilon=1.0, target_delta=1e-5,
                          num_records=100, expected_batch_size=5, optimizer=optax.sgd(0.1), steps=1,
                          method="exact-fast")
