"""The clip methods as objects in one registry, the mechanisms, and the typed gradient functions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from conftest import make_model
from logit_dp import clip_methods as methods
from logit_dp import distributed
from logit_dp._src import methods as methods_lib

LOSS = logit_dp.losses.contrastive(temperature=0.5)
N = 6


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree_util.tree_leaves(tree)])


def test_the_registry_is_the_method_list_and_resolves_names_to_their_default_objects():
  assert methods.METHODS == ("ghost", "materialize", "triangle", "projected")
  assert tuple(methods_lib.REGISTRY) == methods.METHODS == methods.names()
  for name in ("ghost", "materialize", "triangle"):
    method = methods.resolve(name)
    assert isinstance(method, methods.ClipMethod)
    assert method == methods_lib.REGISTRY[name]() and method.name == name
  with pytest.raises(ValueError, match="needs reference_inputs"):
    methods.resolve("projected")
  with pytest.raises(ValueError, match="method must be one of"):
    methods.resolve("exact")


def test_the_old_keywords_still_give_the_objects_with_a_deprecation_warning():
  reference = np.ones((2, 7), np.float32)
  with pytest.warns(DeprecationWarning, match="clip_methods.Ghost"):
    assert methods.resolve("ghost", memory_budget=123) == methods.Ghost(memory_budget=123)
  with pytest.warns(DeprecationWarning, match="clip_methods.Materialize"):
    assert methods.resolve("materialize", pair_block_size=5) == methods.Materialize(5)
  with pytest.warns(DeprecationWarning, match="clip_methods.Projected"):
    projected = methods.resolve("projected", reference_inputs=reference, projection_rank=4)
  assert projected.reference_inputs is reference and projected.rank == 4
  with pytest.warns(DeprecationWarning):  # options of another method are ignored, as before
    assert methods.resolve("triangle", memory_budget=5) == methods.Triangle()
  embed_fn, _, x, _ = make_model("mlp", n=N)
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="projected' only"):
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0, "triangle", reference_inputs=x[:2])
  with pytest.raises(TypeError, match="memory_budgets"):
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0, "ghost", memory_budgets=5)


def test_method_objects_check_their_own_options():
  with pytest.raises(ValueError, match="memory_budget"):
    methods.Ghost(memory_budget=0)
  with pytest.raises(ValueError, match="pair_block_size"):
    methods.Materialize(pair_block_size=True)
  with pytest.raises(ValueError, match="needs reference_inputs"):
    methods.Projected()
  with pytest.raises(ValueError, match="rank"):
    methods.Projected(reference_inputs=np.ones((2, 3)), rank=0)
  embed_fn, params, x, _ = make_model("mlp", n=N)
  with pytest.raises(ValueError, match="reference_inputs must be finite"):
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0,
                          methods.Projected(reference_inputs=np.full((2, 7), np.nan), rank=4))
  with pytest.raises(ValueError, match="one tower"):
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0,
                          methods.Projected(reference_inputs=np.asarray(x[:2]), rank=4),
                          positive_embed_fn=lambda p, xs: embed_fn(p, xs) * 2.0)
  with pytest.raises(ValueError, match="set \\['memory_budget'\\] in it"):
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0, methods.Ghost(), memory_budget=5)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["ghost", "triangle"])
def test_a_method_object_gives_what_its_name_gives(name):
  embed_fn, params, x, x_prime = make_model("mlp", n=N)
  with pytest.warns(DeprecationWarning):
    by_name = logit_dp.clipped_grad(embed_fn, LOSS, 0.05, name, memory_budget=1)
  method = methods.Ghost(memory_budget=1) if name == "ghost" else methods.Triangle()
  by_object = logit_dp.clipped_grad(embed_fn, LOSS, 0.05, method)
  assert by_object.clip_method == by_name.clip_method
  loss_a, grads_a = by_name(params, x, x_prime)
  loss_b, grads_b = by_object(params, x, x_prime)
  assert float(loss_a) == float(loss_b)
  np.testing.assert_array_equal(_flat(grads_a), _flat(grads_b))
  norms = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, methods.resolve(name))
  np.testing.assert_array_equal(
      norms, logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, name))


@pytest.mark.parametrize(
    "name", ["ghost"] +
    [pytest.param(n, marks=pytest.mark.extended) for n in ("materialize", "triangle", "projected")])
def test_every_method_returns_its_norms_then_the_clipped_gradient(name):
  """norms_and_clipped_grad: (norms of pair_norms, ḡ of clipped_grad), in that order."""
  from helpers import make_batch  # pylint: disable=g-import-not-at-top
  embed_fn, params, x, x_prime = make_model("mlp", n=N)
  method = (methods.Projected(reference_inputs=x_prime[:2], rank=4).for_model(embed_fn, None)
            if name == "projected" else methods.resolve(name))
  tau = jax.random.normal(jax.random.PRNGKey(1), (N, N))

  def run(params, x, x_prime):
    batch = make_batch(embed_fn, params, x, x_prime)
    norms, grads = method.norms_and_clipped_grad(batch, tau, 0.05)
    return norms, grads, method.pair_norms(batch), method.clipped_grad(batch, tau, 0.05)

  norms, grads, want_norms, want_grads = jax.jit(run)(params, x, x_prime)
  assert norms.shape == (N, N)
  np.testing.assert_array_equal(norms, want_norms)
  np.testing.assert_array_equal(_flat(grads), _flat(want_grads))


def test_method_objects_are_pytrees_with_static_options():
  reference = jnp.ones((2, 3))
  projected = methods.Projected(reference_inputs=reference, rank=4)
  leaves, treedef = jax.tree_util.tree_flatten(projected)
  assert len(leaves) == 1 and leaves[0] is reference
  assert jax.tree_util.tree_unflatten(treedef, leaves).rank == 4
  assert jax.tree_util.tree_leaves(methods.Ghost(memory_budget=7)) == []
  assert jax.tree_util.tree_structure(methods.Ghost(7)) != jax.tree_util.tree_structure(
      methods.Ghost(8))


def test_mechanisms_name_every_method_list():
  mechanism = logit_dp.Mechanism
  assert [m.value for m in mechanism] == ["logit_dp", "naive_dp", "dp_gcl"]
  assert [m.label for m in mechanism] == ["Logit-DP", "Naive-DP", "DP-GCL"]
  for name in methods.names():
    assert mechanism.of_method(name) is mechanism.LOGIT_DP
  assert mechanism.of_method(methods.Ghost()) is mechanism.LOGIT_DP
  assert mechanism.of_method("naive") is mechanism.NAIVE_DP
  assert mechanism.of_method("dp_gcl") is mechanism.DP_GCL
  with pytest.raises(ValueError, match="method must be one of"):
    mechanism.of_method("logit_dp")


def test_experiments_use_the_mechanism_names():
  from experiments import train  # pylint: disable=g-import-not-at-top
  assert train.PRIVATE_METHODS == ("logit_dp", "naive_dp", "dp_gcl")
  assert train.METHOD_LABELS["naive_dp"] == "Naive-DP"


def test_gradient_functions_carry_their_mechanism_and_sensitivity():
  embed_fn, params, x, x_prime = make_model("mlp", n=N)
  clip_norm = 0.3
  logit = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm, "triangle")
  naive = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSS, clip_norm)
  grouped = logit_dp.baselines.grouped_clipped_grad(embed_fn, LOSS, clip_norm, 2)
  assert isinstance(logit, logit_dp.ClippedGradFn)
  assert (logit.mechanism, logit.method) == (logit_dp.Mechanism.LOGIT_DP, "triangle")
  assert (naive.mechanism, naive.method) == (logit_dp.Mechanism.NAIVE_DP, "naive")
  assert (grouped.mechanism, grouped.method) == (logit_dp.Mechanism.DP_GCL, "dp_gcl")
  assert grouped.num_groups == 2
  # Contrastive, τ = 0.5, n = 6: C = (2 + 2(n−1)p)/τ·B with p = a/(a + n − 1), a = e^{2/τ}.
  a = np.exp(2 / 0.5)
  p = a / (a + N - 1)
  np.testing.assert_allclose(logit.sensitivity(batch_size=N),
                             (2 + 2 * (N - 1) * p) / 0.5 * clip_norm, rtol=1e-12)
  assert logit.sensitivity() == logit_dp.sensitivity(LOSS, clip_norm, batch_size=None)
  assert naive.sensitivity() == grouped.sensitivity() == 2 * clip_norm
  with pytest.raises(ValueError):
    logit_dp.clipped_grad(embed_fn, LOSS, jnp.inf).sensitivity()  # unclipped: not private
  with pytest.raises(dataclasses.FrozenInstanceError):
    logit.clip_norm = 1.0  # type: ignore[misc]
  loss_value, grads = logit(params, x, x_prime)
  loss_again, grads_again, dropped = logit.with_num_dropped(params, x, x_prime)
  assert int(dropped) == 0 and float(loss_value) == float(loss_again)
  np.testing.assert_array_equal(_flat(grads), _flat(grads_again))


def test_make_private_takes_its_sensitivity_from_the_gradient_function():
  embed_fn, _, _, _ = make_model("mlp", n=N)
  for method, expected in (("ghost", logit_dp.sensitivity(LOSS, 0.5)), ("naive", 1.0)):
    private = logit_dp.make_private(embed_fn, LOSS, 0.5, target_epsilon=2.0, target_delta=1e-5,
                                    num_records=1000, expected_batch_size=10,
                                    optimizer=optax.sgd(0.1), steps=10, method=method,
                                    noise_key=jax.random.key(0), sampler_seed=0)
    assert private.sensitivity == expected == private.grad_fn.sensitivity()
    assert private.grad_fn.method == method


@pytest.mark.extended
def test_sharded_method_naive_is_the_naive_flag():
  embed_fn, params, x, x_prime = make_model("mlp", n=N)
  mesh = distributed.data_mesh(1)
  by_method = distributed.make_sharded_grad_fn(embed_fn, LOSS, 0.1, mesh, method="naive")
  by_flag = distributed.make_sharded_grad_fn(embed_fn, LOSS, 0.1, mesh, naive=True)
  assert by_method.mechanism is by_flag.mechanism is logit_dp.Mechanism.NAIVE_DP
  assert by_method.sensitivity() == 0.2 and by_method.mesh is mesh
  loss_a, grads_a = by_method(params, x, x_prime)
  loss_b, grads_b = by_flag(params, x, x_prime)
  assert float(loss_a) == float(loss_b)
  np.testing.assert_array_equal(_flat(grads_a), _flat(grads_b))

  # Naive-DP: the whole-batch gradient clipped to B, against jax.grad of the loss itself.
  def total(p):
    return LOSS(logit_dp.losses.cosine_similarity(embed_fn(p, x), embed_fn(p, x_prime)))

  want = _flat(jax.jit(jax.grad(total))(params))
  want = want * min(1.0, 0.1 / np.linalg.norm(want))
  np.testing.assert_allclose(_flat(grads_a), want, rtol=2e-5, atol=1e-7)
