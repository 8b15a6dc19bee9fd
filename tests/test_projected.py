"""The "projected" pair-norm bound against independent float64 computations.

Truth: per-example Jacobians of the normalised embedding by jax.jacrev in float64, the pair
gradients g_ij = J_iᵀv̂_j + J'_jᵀû_i formed as vectors, and the subspace of the bound as the
row space of the reference inputs' Jacobians (numpy SVD).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from conftest import SmallConv
from conftest import make_model
from helpers import float64_clipped_reference
from helpers import make_batch
from helpers import rel_err
from logit_dp import audit
from logit_dp._src import numerics
from logit_dp._src import pair_terms
from logit_dp._src import projection
from logit_dp._src.methods import bounds
from logit_dp.clip_methods import Projected

N = 8

# Embedding dimensions that take each form of the pair terms (projection.uses_gram_form).
GRAM_FORM_DIM, VECTOR_FORM_DIM = 5, 20
FORMS = pytest.mark.parametrize("dim", [GRAM_FORM_DIM, VECTOR_FORM_DIM],
                                ids=["gram_form", "vector_form"])
_SLOW = pytest.mark.slow


@functools.cache
def _small_conv(dim):
  """One model object per dim: its apply is one function, so what is compiled for it is shared
  by the problems of that dim."""
  return SmallConv(dim=dim)


def _conv_problem(seed=0, spread=0.3, num_reference=3, dim=GRAM_FORM_DIM):
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
  model = _small_conv(dim)
  x = jax.random.uniform(k1, (N, 8, 8, 3))
  x_prime = x + spread * jax.random.normal(k2, x.shape)
  reference = jax.random.uniform(k4, (num_reference, 8, 8, 3))
  return model.apply, model.init(k3, x[:1]), x, x_prime, reference


def _float64_jacobians(embed_fn, params, xs, eps=logit_dp.losses.DEFAULT_COSINE_EPS):
  """(unit embeddings (m, d), Jacobians (m, d, p)) in float64, by jax.jacrev per example."""
  with jax.enable_x64(True):
    p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    flat, unravel = jax.flatten_util.ravel_pytree(p64)

    def unit(w, xe):
      e = embed_fn(unravel(w), jnp.asarray(xe, jnp.float64)[None])[0]
      return e / jnp.sqrt(jnp.sum(e * e) + eps * eps)

    @jax.jit  # one compilation for every example
    def units_and_jacobians(w, xs64):
      return (jax.vmap(lambda xe: unit(w, xe))(xs64),
              jax.vmap(lambda xe: jax.jacrev(unit)(w, xe))(xs64))

    u, j = units_and_jacobians(flat, jnp.asarray(xs, jnp.float64))
    return np.asarray(u), np.asarray(j)


def _float64_truth(embed_fn, params, x, x_prime, reference, rank):
  """(true norms, triangle bound, projected bound, s_i + s'_j), each (n, n), in float64; s the
  Frobenius norms of the normalised embedding's Jacobians, the scale of the float allowances."""
  n = x.shape[0]
  units, jacobians = _float64_jacobians(embed_fn, params, jnp.concatenate([x, x_prime, reference]))
  u, v = units[:n], units[n:2 * n]
  j_u, j_v, j_ref = jacobians[:n], jacobians[n:2 * n], jacobians[2 * n:]
  rows = j_ref.reshape(-1, j_ref.shape[-1])
  _, _, vt = np.linalg.svd(rows, full_matrices=False)
  q = vt[:rank].T  # (p, k), orthonormal
  first = np.einsum("idp,jd->ijp", j_u, v)  # J_iᵀv̂_j
  second = np.einsum("jdp,id->ijp", j_v, u)  # J'_jᵀû_i
  g = first + second
  true = np.linalg.norm(g, axis=-1)
  triangle = np.linalg.norm(first, axis=-1) + np.linalg.norm(second, axis=-1)
  perp = lambda a: a - (a @ q) @ q.T
  projected = np.sqrt(
      np.linalg.norm(g @ q, axis=-1) ** 2
      + (np.linalg.norm(perp(first), axis=-1) + np.linalg.norm(perp(second), axis=-1)) ** 2)
  scale = np.linalg.norm(j_u, axis=(1, 2))[:, None] + np.linalg.norm(j_v, axis=(1, 2))[None, :]
  return true, triangle, projected, scale


def test_the_test_dimensions_take_both_forms():
  assert projection.uses_gram_form(GRAM_FORM_DIM) and not projection.uses_gram_form(VECTOR_FORM_DIM)


# The gram form's float32 error and its removal audit run by default in
# test_gram_form_float32_error_is_a_sixteenth_of_its_allowance and
# test_removal_audit_at_a_tiny_clip_norm_respects_the_sensitivity[gram_form].
@pytest.fixture(scope="module",
                params=[pytest.param(GRAM_FORM_DIM, marks=pytest.mark.extended),
                        VECTOR_FORM_DIM], ids=["gram_form", "vector_form"])
def conv_case(request):
  embed_fn, params, x, x_prime, reference = _conv_problem(dim=request.param)
  # Each normalised Jacobian has rank d − 1 (ûᵀJ = 0): 3 references × (d − 1) rows of rank, the
  # rest of their 3d singular directions are rounding, different in float32 and float64.
  rank = 3 * (request.param - 1)
  truth = _float64_truth(embed_fn, params, x, x_prime, reference, rank=rank)
  return embed_fn, params, x, x_prime, reference, rank, truth


@pytest.mark.slow
def test_bound_matches_its_float64_formula_off_the_diagonal(conv_case):
  """k = m·(d − 1), the reference rows' rank: their span, well defined in float32 too."""
  embed_fn, params, x, x_prime, reference, rank, (true, triangle, projected, scale) = conv_case
  got = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime,
                                            Projected(reference_inputs=reference, rank=rank),
                                            float_allowance=False), np.float64)
  off = ~np.eye(N, dtype=bool)
  want = np.minimum(projected, triangle)
  # float32 without allowances: the perpendicular parts a − ‖Q̃ᵀJ_iᵀv̂_j‖² cancel terms of
  # order s², so a small bound's relative error can reach 1e-3. The squared error stays within
  # the Gram allowance ε_G·(s_i + s'_j)² that float_allowance=True adds for it (measured: 1/13
  # of it at d = 20, 1/72 at d = 5), and is ~1e-4 relative at the median.
  squared_error = np.abs(got ** 2 - want ** 2)[off] / scale[off] ** 2
  assert squared_error.max() <= numerics.GRAM_FLOAT_ERROR, squared_error.max()
  assert np.median(np.abs(got - want)[off] / want[off]) < 1e-3
  np.testing.assert_allclose(np.diag(got), np.diag(true), rtol=2e-4)  # diagonal: exact vectors
  # It is a real improvement: tighter than triangle, and an upper bound of the truth.
  assert np.all(projected >= true * (1 - 1e-12))
  assert np.median(projected[off] / true[off]) < np.median(triangle[off] / true[off]) - 0.1


def test_with_allowances_it_is_never_below_the_truth_nor_above_triangle(conv_case):
  embed_fn, params, x, x_prime, reference, _, (true, _, _, _) = conv_case
  got = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime,
                                            Projected(reference_inputs=reference, rank=7),
                                            microbatch_size=3), np.float64)
  tri = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "triangle"),
                   np.float64)
  assert np.all(got >= true * (1 - 2.0 ** -23)), np.min(got / true)
  assert np.all(got <= tri)


def _float32_projections(embed_fn, params, x, x_prime, reference, rank):
  """(J_iQ̃, û, J'_jQ̃, v̂, s, s') as the library computes them in float32 (under jit, as in
  clipped_grad)."""
  return _float32_projections_fn(embed_fn, rank)(params, x, x_prime, reference)


@functools.cache
def _float32_projections_fn(embed_fn, rank):
  @jax.jit
  def projections(params, x, x_prime, reference):
    batch = make_batch(embed_fn, params, x, x_prime)
    tangents, _ = bounds.projection_tangents(batch, reference, rank)
    f_u, f_v = batch.factors(batch.x), batch.factors(batch.x_prime)
    return (bounds.projected_jacobians(batch, f_u, tangents), batch.u_loc,
            bounds.projected_jacobians(batch, f_v, tangents), batch.v,
            pair_terms.jacobian_norms(f_u.gram), pair_terms.jacobian_norms(f_v.gram))

  return projections


# By default near-identical views (the stress) on the diagonal and off it ("shifted"), at the
# longest contraction (the largest error; both share one compilation); the rest is slow.
_DEFAULT_GRAM_CASES = {("near_identical", 128), ("shifted", 128)}


@pytest.mark.parametrize("family,dim,num_reference,rank", [
    pytest.param(family, dim, num_reference, rank, marks=() if
                 (family, rank) in _DEFAULT_GRAM_CASES else _SLOW)
    for family in ("near_identical", "shifted", "unrelated")
    for dim, num_reference, rank in ((5, 3, 12), (5, 8, 32), (8, 16, 128))
])
def test_gram_form_float32_error_is_a_sixteenth_of_its_allowance(family, dim, num_reference, rank):
  """‖X + Y‖², ‖X‖², ‖Y‖² from the Gram forms against float64 from the same float32
  projections, relative to (s_i + s'_j)², s_i², s'_j²: the Gram allowance ε_G covers 16× the
  largest error (near-identical views, where X and Y nearly cancel; rank 128 at d = 8, the
  largest d that takes the Gram form: a contraction of d²k = 8,192)."""
  embed_fn, params, x, x_prime, reference = _conv_problem(seed=1, num_reference=num_reference,
                                                          dim=dim)
  if family != "unrelated":
    noise = 1e-2 * jax.random.normal(jax.random.PRNGKey(5), x.shape)
    x_prime = (x if family == "near_identical" else jnp.roll(x, 1, axis=0)) + noise
  p_u, u, p_v, v, s_u, s_v = _float32_projections(embed_fn, params, x, x_prime, reference, rank)
  assert projection.uses_gram_form(dim) and p_u.shape[-1] == rank
  got = projection.gram_norms(p_u, u, projection.gram_columns(p_v, v), s_u, s_v, 0.0)
  a, b, c, d = (np.asarray(t, np.float64) for t in (p_u, u, p_v, v))
  x_vec, y_vec = np.einsum("idk,jd->ijk", a, d), np.einsum("jdk,id->ijk", c, b)
  s_i, s_j = np.asarray(s_u, np.float64)[:, None], np.asarray(s_v, np.float64)[None, :]
  errors = [
      np.abs(np.asarray(g, np.float64) ** 2 - np.sum(w * w, axis=-1)) / scale ** 2
      for g, w, scale in zip(got, (x_vec + y_vec, x_vec, y_vec), (s_i + s_j, s_i, s_j))
  ]
  assert max(e.max() for e in errors) * 16 <= numerics.GRAM_FLOAT_ERROR
  # ... and with the allowance each bounds the vector form's norm on the right side.
  upper, x_low, y_low, sum_low = (np.asarray(t, np.float64) for t in projection.gram_norms(
      p_u, u, projection.gram_columns(p_v, v), s_u, s_v, numerics.GRAM_FLOAT_ERROR))
  assert np.all(upper >= np.linalg.norm(x_vec + y_vec, axis=-1))
  assert np.all(sum_low <= np.linalg.norm(x_vec + y_vec, axis=-1))
  assert np.all(x_low <= np.linalg.norm(x_vec, axis=-1))
  assert np.all(y_low <= np.linalg.norm(y_vec, axis=-1))


@pytest.mark.slow  # shows the bound reaches the exact norm; the formula is checked by default
def test_a_reference_spanning_every_jacobian_gives_the_exact_norms():
  """With the batch's own inputs as the (here not public) reference, the subspace holds every
  pair gradient: the bound is the exact norm, up to its float32 allowances."""
  embed_fn, params, x, x_prime, _ = _conv_problem(seed=2, num_reference=1)
  both = jnp.concatenate([x, x_prime])
  true, triangle, _, scale = _float64_truth(embed_fn, params, x, x_prime, both, rank=2 * N * 5)
  got = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime,
                                            Projected(reference_inputs=both, rank=2 * N * 5)),
      np.float64)
  assert np.all(got >= true * (1 - 2.0 ** -23))
  off = ~np.eye(N, dtype=bool)
  # Above the truth by at most the float32 allowances, √ε_G·s per Gram half and the vector
  # allowance √k·ε_V·S in the subspace (as ghost's exact norms: test_float32_norms).
  allowance = (numerics.GRAM_FLOAT_ERROR ** 0.5 + np.sqrt(2 * N * 5) * numerics.VECTOR_FLOAT_ERROR)
  assert np.all(got[off] <= true[off] + 1.01 * allowance * scale[off])
  assert np.median(got[off] / true[off]) < 1.01
  assert np.all(got <= pair_terms.FLAG_RATIO * true), np.max(got / true)  # flagged: recomputed
  assert np.median(triangle[off] / true[off]) > 1.3  # where triangle is loose


@pytest.mark.extended
def test_each_pair_norm_depends_on_its_own_pair_only():
  """Privacy: removing a pair record leaves every other pair's clip norm unchanged (the
  subspace comes from the public reference, never from the batch)."""
  embed_fn, params, x, x_prime, reference = _conv_problem(seed=3)
  projected = Projected(reference_inputs=reference, rank=10)
  full = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, projected))
  for k in (0, 5):
    keep = np.flatnonzero(np.arange(N) != k)
    part = np.asarray(
        logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x[keep], x_prime[keep], projected))
    np.testing.assert_allclose(part, full[np.ix_(keep, keep)], rtol=1e-6)


@pytest.mark.extended
def test_clipped_grad_is_the_clipped_sum_of_materialised_pair_gradients():
  """ḡ = Σ_ij τ_ij·min(1, B/N_ij)·∇Z_ij with N_ij the projected norms and ∇Z_ij by jax.grad
  (in float64, `helpers.float64_clipped_reference`)."""
  embed_fn, params, x, x_prime = make_model("mlp", n=N, seed=4)
  reference = jax.random.normal(jax.random.PRNGKey(11), (3,) + x.shape[1:])
  loss = logit_dp.losses.contrastive(temperature=0.5)
  projected = Projected(reference_inputs=reference, rank=8)
  norms = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, projected))
  clip_norm = float(np.median(norms))
  _, got = logit_dp.clipped_grad(embed_fn, loss, clip_norm, projected)(params, x, x_prime)

  with jax.enable_x64(True):
    _, want = float64_clipped_reference(embed_fn, loss, params, x, x_prime, clip_norm,
                                        clip_by=norms)
  assert rel_err(got, want) < 1e-4
  assert np.mean(norms > clip_norm) > 0.3  # clipping happened


@pytest.mark.slow  # microbatched norms are checked by default in test_float32_norms
def test_microbatches_and_jit_give_the_same_gradient():
  embed_fn, params, x, x_prime, reference = _conv_problem(seed=5)
  loss = logit_dp.losses.contrastive(temperature=1.0)
  projected = Projected(reference_inputs=reference, rank=8)
  _, whole = logit_dp.clipped_grad(embed_fn, loss, 0.05, projected)(params, x, x_prime)
  fn = logit_dp.clipped_grad(embed_fn, loss, 0.05, projected, microbatch_size=3)
  _, micro = jax.jit(fn)(params, x, x_prime)
  assert rel_err(micro, whole) < 1e-5


# Slow: the sharded paths are tested by default in tests/test_distributed.py.
@pytest.mark.parametrize(
    "dim", [pytest.param(GRAM_FORM_DIM, marks=_SLOW),
            pytest.param(VECTOR_FORM_DIM, marks=_SLOW)], ids=["gram_form", "vector_form"])
def test_sharded_over_two_devices_equals_one_device(dim):
  from logit_dp import distributed
  embed_fn, params, x, x_prime, reference = _conv_problem(seed=8, dim=dim)
  loss = logit_dp.losses.contrastive(temperature=1.0)
  projected = Projected(reference_inputs=reference, rank=8)
  _, single = logit_dp.clipped_grad(embed_fn, loss, 0.05, projected)(params, x, x_prime)
  sharded = distributed.make_sharded_grad_fn(embed_fn, loss, 0.05, distributed.data_mesh(2),
                                             method=projected)
  _, got = sharded(params, x, x_prime)
  assert rel_err(got, single) < 1e-5


# The vector form's norms are checked against the truth by default in
# test_with_allowances_it_is_never_below_the_truth_nor_above_triangle[vector_form].
@pytest.mark.parametrize(
    "dim", [GRAM_FORM_DIM, pytest.param(VECTOR_FORM_DIM, marks=pytest.mark.extended)],
    ids=["gram_form", "vector_form"])
def test_removal_audit_at_a_tiny_clip_norm_respects_the_sensitivity(dim):
  embed_fn, params, x, _, reference = _conv_problem(seed=6, dim=dim)
  x_prime = x + 1e-2 * jax.random.normal(jax.random.PRNGKey(9), x.shape)  # near-identical
  loss = logit_dp.losses.contrastive(temperature=1.0)
  result = audit.max_removal_ratio(embed_fn, params, loss, 1e-5, x, x_prime, method="projected",
                                   reference_inputs=reference, projection_rank=8)
  assert 0.0 < result.ratio <= 1.0, result.ratio


@pytest.mark.slow  # a 4-restart random search of the removal audit
def test_worst_case_search_finds_no_breach():
  embed_fn, params, x, x_prime, reference = _conv_problem(seed=7)
  result = audit.search_worst_case(embed_fn, params, logit_dp.losses.contrastive(temperature=1.0),
                                   1e-3, x, x_prime, key=jax.random.PRNGKey(0), num_restarts=4,
                                   num_steps=0, method="projected", reference_inputs=reference,
                                   projection_rank=8)
  assert result.ratio <= 1.0


def test_basis_is_orthonormal_and_its_error_is_measured():
  rows = jax.random.normal(jax.random.PRNGKey(0), (12, 50))
  basis = jax.jit(projection.basis, static_argnums=1)
  q, eta = basis(rows, 5)
  assert q.shape == (50, 5)
  deviation = np.abs(np.asarray(q.T @ q, np.float64) - np.eye(5)).max()
  assert deviation <= float(eta) < 1e-4
  # The top-5 right singular subspace (float64 SVD): projectors agree.
  _, _, vt = np.linalg.svd(np.asarray(rows, np.float64))
  want = vt[:5].T @ vt[:5]
  got = np.asarray(q, np.float64) @ np.asarray(q, np.float64).T
  assert np.abs(got - want).max() < 1e-4
  # A rank above the number of rows is cut to it; rank-deficient rows still give a basis.
  q, eta = basis(jnp.concatenate([rows[:2], rows[:2]]), 10)
  assert q.shape == (50, 4) and float(eta) < 1e-4


def test_bad_arguments_raise_value_errors():
  embed_fn, params, x, x_prime = make_model("mlp", n=4)
  loss = logit_dp.losses.contrastive(temperature=1.0)
  with pytest.raises(ValueError, match="needs reference_inputs"):
    logit_dp.clipped_grad(embed_fn, loss, 1.0, "projected")
  with pytest.raises(ValueError, match="rank"):
    Projected(reference_inputs=x, rank=0)
  with pytest.raises(ValueError, match="finite"):
    logit_dp.clipped_grad(embed_fn, loss, 1.0, Projected(reference_inputs=x.at[0, 0].set(np.nan)))
  with pytest.raises(ValueError, match="at least one example"):
    logit_dp.clipped_grad(embed_fn, loss, 1.0, Projected(reference_inputs=x[:0]))
  with pytest.raises(ValueError, match="one tower"):
    logit_dp.clipped_grad(embed_fn, loss, 1.0, Projected(reference_inputs=x),
                          positive_embed_fn=lambda p, a: embed_fn(p, a) * 2.0)
  with pytest.raises(ValueError, match="projected' only"):
    audit.max_removal_ratio(embed_fn, params, loss, 1.0, x, x_prime, method="ghost",
                            reference_inputs=x)


@pytest.mark.slow  # wiring: make_private takes the method object
def test_make_private_trains_with_projected():
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  import optax
  private = logit_dp.make_private(embed_fn, logit_dp.losses.contrastive(temperature=1.0), 1.0,
                                  target_epsilon=5.0, target_delta=1e-5, num_records=600,
                                  expected_batch_size=6, optimizer=optax.adam(1e-2), steps=10,
                                  method=Projected(reference_inputs=x_prime[:2], rank=4),
                                  noise_key=jax.random.PRNGKey(0), sampler_seed=0)
  state = private.optimizer.init(params)
  _, grads = private.grad_fn(params, x, x_prime)
  updates, _ = private.optimizer.update(grads, state, params)
  assert np.all(
      np.isfinite(np.concatenate([np.ravel(u) for u in jax.tree_util.tree_leaves(updates)])))
  assert private.sensitivity == logit_dp.sensitivity(logit_dp.losses.contrastive(temperature=1.0),
                                                     1.0, batch_size=None)
  assert logit_dp.clip_methods.METHODS[-1] == "projected"


def _one_mlp_two_ways():
  """(x, x', reference, (embed_fn, params) as a flax MLP, the same maths as a plain function of
  a dict of its leaves): d = 4, 8 reference inputs, so 24 directions."""
  from conftest import MLP
  model = MLP(features=(16, 4))
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(k1, (N, 7))
  x_prime = x + 0.5 * jax.random.normal(k2, (N, 7))
  reference = jax.random.normal(k4, (8, 7))
  params = model.init(k3, x[:1])
  first, second = params["params"]["Dense_0"], params["params"]["Dense_1"]
  plain = {"w1": first["kernel"], "b1": first["bias"], "w2": second["kernel"], "b2": second["bias"]}

  def plain_fn(p, xs):
    return jnp.tanh(xs @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

  return x, x_prime, reference, (model.apply, params), (plain_fn, plain)


@pytest.mark.parametrize(
    "x64,tolerance",
    [(False, 1e-6), pytest.param(True, 1e-12, marks=pytest.mark.slow)], ids=["float32", "float64"])
@pytest.mark.slow
def test_the_basis_stops_at_the_numerical_rank(x64, tolerance):
  """Rank 32 > the 24 directions of the references: the same model written two ways gives the
  same norms (keeping the 8 rounding directions put them 2.4% apart), never below the exact
  norms of materialize."""
  x, x_prime, reference, *models = _one_mlp_two_ways()
  with jax.enable_x64(x64):
    cast = lambda t: jax.tree_util.tree_map(
        lambda a: jnp.asarray(a, jnp.float64 if x64 else jnp.float32), t)
    x, x_prime, reference = cast((x, x_prime, reference))
    norms = []
    for embed_fn, params in models:
      fresh = lambda p, xs, f=embed_fn: f(p, xs)
      norms.append(
          np.asarray(
              logit_dp.clip_methods.pair_grad_norms(fresh, cast(params), x, x_prime,
                                                    Projected(reference_inputs=reference, rank=32)),
              np.float64))
      batch = make_batch(fresh, cast(params), reference, reference)
      q, eta = bounds.projection_tangents(batch, reference, 32)
      column_mass = sum(np.sum(np.abs(np.asarray(t).reshape(32, -1)), axis=1) for t in q)
      assert np.count_nonzero(column_mass) == 24 and float(eta) < 1e-3
    exact = np.asarray(
        logit_dp.clip_methods.pair_grad_norms(models[0][0], cast(models[0][1]), x, x_prime,
                                              "materialize", float_allowance=False), np.float64)
  assert np.max(np.abs(norms[0] / norms[1] - 1)) < tolerance
  assert np.all(norms[0] >= exact) and np.all(norms[1] >= exact)
