"""clipped_grad against independent computations: jax.grad and the materialised reference."""

import itertools
import warnings

import jax
import jax.extend  # noqa: F401  (jax.extend.core.jaxprs_in_params)
import jax.numpy as jnp
import numpy as np
import pytest

import logit_dp
from conftest import make_model
from helpers import clip_method
from helpers import reference_grad
from helpers import rel_err
from helpers import tree_norm

LOSSES = {
    "contrastive": logit_dp.losses.contrastive(temperature=0.5),
    "spreadout": logit_dp.losses.spreadout(),
}

_SLOW = pytest.mark.slow
# The default run keeps ghost on the mlp and the contrastive loss; the extended run the mlp with
# each other method, and ghost on spreadout; the conv net's layers are checked against jax.grad
# by test_layerwise, test_ghost_blocks and test_float32_norms. The rest of the grid is slow.
_DEFAULT_INFINITE_CLIP = {("mlp", "ghost", "contrastive")}
_EXTENDED_INFINITE_CLIP = {("mlp", m, "contrastive") for m in logit_dp.clip_methods.METHODS
                          } | {("mlp", "ghost", "spreadout")}


def _infinite_clip_marks(case):
  if case in _DEFAULT_INFINITE_CLIP:
    return ()
  return pytest.mark.extended if case in _EXTENDED_INFINITE_CLIP else _SLOW


@pytest.mark.parametrize("kind,method,loss_name", [
    pytest.param(*case, marks=_infinite_clip_marks(case))
    for case in itertools.product(("mlp", "conv"), logit_dp.clip_methods.METHODS, sorted(LOSSES))
])
def test_infinite_clip_norm_is_jax_grad(kind, loss_name, method):
  embed_fn, params, x, x_prime = make_model(kind, n=6)
  loss = LOSSES[loss_name]
  ref_loss, ref_grads = reference_grad(embed_fn, loss, params, x, x_prime)
  value, grads = logit_dp.clipped_grad(embed_fn, loss, jnp.inf,
                                       method=clip_method(method, x))(params, x, x_prime)
  np.testing.assert_allclose(value, ref_loss, rtol=1e-5)
  assert rel_err(grads, ref_grads) < 1e-5


# Slow: by default test_ghost_blocks compares one-block ghost and materialize ḡ (clipped, with a
# mask) on this mlp through the blocked path, which matches both.
@pytest.mark.parametrize("kind,loss_name", [
    pytest.param("mlp", "contrastive", marks=_SLOW),
    pytest.param("mlp", "spreadout", marks=_SLOW),
    pytest.param("conv", "contrastive", marks=_SLOW),
    pytest.param("conv", "spreadout", marks=_SLOW),
])
def test_ghost_matches_materialize_with_clipping(kind, loss_name, no_float_allowance):
  embed_fn, params, x, x_prime = make_model(kind, n=8, seed=1)
  loss = LOSSES[loss_name]
  norms = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method="materialize")
  clip_norm = float(jnp.median(norms))  # about half of the pairs are clipped
  _, exact = logit_dp.clipped_grad(embed_fn, loss, clip_norm, method="materialize")(params, x,
                                                                                    x_prime)
  _, ghost = logit_dp.clipped_grad(embed_fn, loss, clip_norm, method="ghost")(params, x, x_prime)
  assert rel_err(ghost, exact) < 1e-4
  # Clipping really happened: the clipped gradient differs from the unclipped one.
  _, unclipped = reference_grad(embed_fn, loss, params, x, x_prime)
  assert rel_err(exact, unclipped) > 1e-2


# Slow: test_float32_norms bounds the ghost norms between the float64 jax.grad norms and the
# float allowance above them by default.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=_SLOW) for k in ("mlp", "conv")])
def test_ghost_pair_norms_match_materialized_pair_gradients(kind):
  embed_fn, params, x, x_prime = make_model(kind, n=7, seed=2)
  ghost = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method="ghost",
                                                float_allowance=False)
  exact = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method="materialize",
                                                float_allowance=False)
  # Independent check of one entry: the norm of jax.grad of Z_ij.
  i, j = 3, 5
  z = lambda p: logit_dp.losses.cosine_similarity(embed_fn(p, x[i:i + 1]),
                                                  embed_fn(p, x_prime[j:j + 1]))[0, 0]
  np.testing.assert_allclose(exact[i, j], tree_norm(jax.grad(z)(params)), rtol=1e-5)
  np.testing.assert_allclose(ghost, exact, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mlp", pytest.param("conv", marks=_SLOW)])
def test_triangle_bound_is_an_upper_bound_and_clips_every_pair_to_b(kind):
  embed_fn, params, x, x_prime = make_model(kind, n=7, seed=3)
  exact = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method="materialize",
                                                float_allowance=False)
  bound = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method="triangle")
  assert np.all(np.asarray(bound) >= np.asarray(exact) * (1 - 1e-5))
  assert np.any(np.asarray(bound) > np.asarray(exact) * 1.01)  # a real bound, not the exact norm


@pytest.mark.parametrize(
    "method",
    [m if m == "ghost" else pytest.param(m, marks=_SLOW) for m in logit_dp.clip_methods.METHODS])
def test_mask_padding_contributes_nothing(method):
  embed_fn, params, x, x_prime = make_model("mlp", n=9, seed=4)
  loss = LOSSES["contrastive"]
  mask = jnp.array([1, 1, 0, 1, 1, 1, 0, 1, 0], bool)
  keep = np.flatnonzero(np.asarray(mask))
  padded_x = x.at[~mask].set(jnp.nan)  # garbage in padded rows must not leak
  padded_xp = x_prime.at[~mask].set(1e30)
  fn = logit_dp.clipped_grad(embed_fn, loss, 0.5, method=clip_method(method, x))
  value_masked, grads_masked = fn(params, padded_x, padded_xp, mask)
  value_small, grads_small = fn(params, x[keep], x_prime[keep])
  np.testing.assert_allclose(value_masked, value_small, rtol=1e-5)
  assert rel_err(grads_masked, grads_small) < 1e-5


# Slow: microbatches are compared with whole batches by default in test_ghost_blocks (ghost, one
# block) and test_hardening; test_float32_norms checks microbatched norms of every method.
@pytest.mark.slow
@pytest.mark.parametrize("method", ["ghost", "triangle"])
def test_microbatching_keeps_the_whole_pair_matrix(method):
  embed_fn, params, x, x_prime = make_model("conv", n=10, seed=5)
  loss = LOSSES["contrastive"]
  _, whole = logit_dp.clipped_grad(embed_fn, loss, 0.3, method=method)(params, x, x_prime)
  _, micro = logit_dp.clipped_grad(embed_fn, loss, 0.3, method=method, microbatch_size=3)(params, x,
                                                                                          x_prime)
  assert rel_err(micro, whole) < 1e-5


@pytest.mark.parametrize("kind", ["mlp", pytest.param("conv", marks=_SLOW)])
def test_naive_clipped_grad_is_jax_grad_clipped_to_b(kind):
  embed_fn, params, x, x_prime = make_model(kind, n=6)
  loss = LOSSES["contrastive"]
  _, ref = reference_grad(embed_fn, loss, params, x, x_prime)
  _, unclipped = logit_dp.baselines.naive_clipped_grad(embed_fn, loss, jnp.inf)(params, x, x_prime)
  assert rel_err(unclipped, ref) < 1e-5
  clip_norm = tree_norm(ref) / 3
  _, clipped = logit_dp.baselines.naive_clipped_grad(embed_fn, loss, clip_norm)(params, x, x_prime)
  np.testing.assert_allclose(tree_norm(clipped), clip_norm, rtol=1e-5)
  assert rel_err(jax.tree_util.tree_map(lambda g: 3 * g, clipped), ref) < 1e-5


def _contraction_precisions(jaxpr):
  """The precision of every dot_general and convolution in a closed jaxpr, sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      found.append(eqn.params["precision"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found.extend(_contraction_precisions(sub))
  return found


@pytest.mark.parametrize(
    "method",
    [m if m == "ghost" else pytest.param(m, marks=_SLOW) for m in logit_dp.clip_methods.METHODS])
def test_private_gradient_contracts_at_full_float32_whatever_the_ambient_precision(method):
  # The clip factors and ḡ come from different passes: on a GPU, where JAX's default for
  # float32 is TF32, they must still both be float32-accurate.
  embed_fn, params, x, x_prime = make_model("conv", n=4)
  fn = logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], 1.0, method=clip_method(method, x),
                             microbatch_size=2)
  mask = jnp.ones((4,), bool)
  highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
  with jax.default_matmul_precision("bfloat16"):  # the traced core: no eager input checks to run
    precisions = _contraction_precisions(jax.make_jaxpr(fn.core)(params, x, x_prime, mask).jaxpr)
    ambient = _contraction_precisions(jax.make_jaxpr(embed_fn)(params, x).jaxpr)
  assert ambient and all(p != highest for p in ambient)  # the context does change the default
  assert len(precisions) > 10
  assert all(p == highest for p in precisions), set(map(str, precisions))


def test_naive_dp_contracts_at_full_float32_whatever_the_ambient_precision():
  # ‖∇ℒ‖ and the clipped gradient: every contraction of the core (and of the statistics' core)
  # at "highest", whatever the ambient default.
  embed_fn, params, x, x_prime = make_model("conv", n=4)
  fn = logit_dp.baselines.naive_clipped_grad(embed_fn, LOSSES["contrastive"], 1.0,
                                             microbatch_size=2)
  mask = jnp.ones((4,), bool)
  highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
  with jax.default_matmul_precision("bfloat16"):
    ambient = _contraction_precisions(jax.make_jaxpr(embed_fn)(params, x).jaxpr)
    for core in (fn.core, fn.stats_core):
      precisions = _contraction_precisions(jax.make_jaxpr(core)(params, x, x_prime, mask).jaxpr)
      assert len(precisions) > 5
      assert all(p == highest for p in precisions), set(map(str, precisions))
  assert ambient and all(p != highest for p in ambient)  # the context does change the default


@pytest.mark.parametrize("builder", ["clipped_grad", "naive_clipped_grad"])
def test_eager_call_on_an_empty_batch_warns(builder):
  embed_fn, params, x, x_prime = make_model("mlp", n=4)
  fn = getattr(logit_dp, builder)(embed_fn, LOSSES["contrastive"], 1.0)
  with pytest.warns(logit_dp.EmptyBatchWarning, match="no valid pair"):
    loss, grads = fn(params, x, x_prime, jnp.zeros((4,), bool))
  assert float(loss) == 0.0 and tree_norm(grads) == 0.0
  with warnings.catch_warnings():  # a batch with a valid pair, and any batch under jit: silent
    warnings.simplefilter("error")
    fn(params, x, x_prime, jnp.array([0, 0, 1, 0]))
    jax.jit(fn)(params, x, x_prime, jnp.zeros((4,), bool))


@pytest.mark.slow  # a tracing count; jit = eager is checked by the non-finite test below
def test_grad_fn_jits_and_does_not_retrace():
  embed_fn, params, x, x_prime = make_model("mlp", n=6)
  traces = []

  def counting_embed(p, xs):
    traces.append(1)
    return embed_fn(p, xs)

  fn = logit_dp.clipped_grad(counting_embed, LOSSES["spreadout"], 1.0)
  fn(params, x, x_prime)
  first = len(traces)
  for s in range(3):
    fn(params, x + s, x_prime)
  assert len(traces) == first
  jitted = jax.jit(fn)
  eager = fn(params, x, x_prime)
  np.testing.assert_allclose(jitted(params, x, x_prime)[0], eager[0], rtol=1e-6)


@pytest.mark.slow  # a zero embedding's gradient I/ε: finite; non-finite rows are tested by default
def test_zero_embedding_gives_finite_gradients():
  def embed_fn(params, xs):
    return xs * params["scale"]  # the first example embeds to exactly 0

  params = {"scale": jnp.ones((4,))}
  x = jnp.array([[0.0, 0, 0, 0], [1, 2, 0, 1], [0, 1, 1, 0]])
  x_prime = jnp.array([[1.0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
  for method in logit_dp.clip_methods.METHODS:
    value, grads = logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], 1.0,
                                         method=clip_method(method, x))(params, x, x_prime)
    assert np.isfinite(value) and np.all(np.isfinite(grads["scale"]))


def test_nonfinite_embeddings_raise_eagerly_and_are_masked_under_jit():
  embed_fn, params, x, x_prime = make_model("mlp", n=5)
  bad = x.at[2, 0].set(jnp.inf)
  fn = logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], 1.0)
  with pytest.raises(ValueError, match="non-finite"):
    fn(params, bad, x_prime)
  with pytest.raises(ValueError, match="non-finite"):
    logit_dp.baselines.naive_clipped_grad(embed_fn, LOSSES["contrastive"], 1.0)(params, bad,
                                                                                x_prime)
  value, grads = jax.jit(fn)(params, bad, x_prime)
  mask = jnp.arange(5) != 2
  expected_value, expected = fn(params, x, x_prime, mask)
  np.testing.assert_allclose(value, expected_value, rtol=1e-6)
  assert rel_err(grads, expected) < 1e-6


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip_norm=0.0), "clip_norm"),
    (dict(clip_norm=-1.0), "clip_norm"),
    (dict(clip_norm=float("nan")), "clip_norm"),
    (dict(clip_norm="big"), "clip_norm"),
    (dict(clip_norm=1.0, method="exact"), "method"),
    (dict(clip_norm=1.0, microbatch_size=0), "microbatch_size"),
])
def test_bad_construction_arguments(kwargs, match):
  embed_fn, _, _, _ = make_model("mlp", n=4)
  with pytest.raises(ValueError, match=match):
    logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], **kwargs)


def test_bad_batches():
  embed_fn, params, x, x_prime = make_model("mlp", n=4)
  fn = logit_dp.clipped_grad(embed_fn, LOSSES["contrastive"], 1.0)
  with pytest.raises(ValueError, match="same number of examples"):
    fn(params, x, x_prime[:3])
  with pytest.raises(ValueError, match="at least 2 pairs"):
    fn(params, x[:1], x_prime[:1])
  with pytest.raises(ValueError, match="mask"):
    fn(params, x, x_prime, jnp.ones((3,), bool))


def test_ghost_layer_chunks_of_any_row_count_give_the_exact_norms(monkeypatch):
  """On the CPU a ghost layer's pair terms come in chunks of GHOST_LAYER_CHUNK_PAIRS // n rows
  (8 up to n = 512, 4 at n = 1,000, 1 from n = 4,096); chunks of 3 rows, the last one padded,
  give the materialised norms too."""
  from logit_dp._src import chunking
  from logit_dp._src import layerwise
  assert [chunking.ghost_layer_chunk_rows(n) for n in (2, 512, 1000, 2000, 4096, 10 ** 5)
         ] == [8, 8, 4, 2, 1, 1]
  embed_fn, params, x, x_prime = make_model("conv", n=7)
  monkeypatch.setattr(layerwise, "use_ghost", lambda layer, d: True)
  exact = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize",
                                                float_allowance=False)
  monkeypatch.setattr(chunking, "ghost_layer_chunk_rows", lambda n: 3)
  fresh = lambda p, xs: embed_fn(p, xs)  # a new function: nothing compiled is reused
  norms = logit_dp.clip_methods.pair_grad_norms(fresh, params, x, x_prime, "ghost",
                                                float_allowance=False)
  atol = 1e-5 * float(np.max(exact))  # as in test_accelerator_pair_chunks_give_the_same_exact_norms
  np.testing.assert_allclose(norms, exact, rtol=1e-4, atol=atol)


@pytest.mark.slow  # the accelerator's chunking simulated on CPU (conv, n = 13)
def test_accelerator_pair_chunks_give_the_same_exact_norms(monkeypatch):
  """The accelerator's larger, uncapped pair-term chunks (one chunk of 13 rows here, against
  the CPU's two padded chunks of 8) give the materialised norms too."""
  from logit_dp._src import chunking
  from logit_dp._src import layerwise
  embed_fn, params, x, x_prime = make_model("conv", n=13)
  monkeypatch.setattr(layerwise, "use_ghost", lambda layer, d: True)
  exact = logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize",
                                                float_allowance=False)
  norms = {}
  for accelerator in (False, True):
    monkeypatch.setattr(chunking, "on_accelerator", lambda a=accelerator: a)
    fresh = lambda p, xs: embed_fn(p, xs)  # a new function: nothing compiled is reused
    norms[accelerator] = logit_dp.clip_methods.pair_grad_norms(fresh, params, x, x_prime, "ghost",
                                                               float_allowance=False)
  # Other chunk shapes round differently; small norms carry the cancellation of
  # ‖g‖² = a + b + 2c (atol, as in test_layerwise._check_norms).
  atol = 1e-5 * float(np.max(exact))
  np.testing.assert_allclose(norms[True], norms[False], rtol=1e-5, atol=atol)
  np.testing.assert_allclose(norms[True], exact, rtol=1e-4, atol=atol)


@pytest.mark.slow  # two compilations of a wider conv net's ghost gradient, n = 64 and 256
def test_ghost_never_allocates_n_squared_p_floats():
  """XLA's own buffer assignment for the ghost step grows as O(n·d·p + n²·d²), never n²·p.

  Compared as growth from n = 64 to n = 256, so that a backend's fixed scratch (GPU
  convolution and GEMM workspaces) does not count as growth in n.
  """
  from conftest import SmallConv
  from logit_dp._src import chunking
  from logit_dp._src import layerwise
  model, d = SmallConv(channels=(16, 32), dim=5), 5
  # One chunk of a ghost layer's pair terms: rows × n × (T² + 2TC + d) floats, at most the
  # chunk budget (larger on an accelerator).
  chunk_budget, _ = chunking.backend_chunk_limits(chunking.GHOST_LAYER_CHUNK_FLOATS,
                                                  chunking.GHOST_LAYER_CHUNK_ROWS)
  temp, budget = {}, {}
  for n in (64, 256):
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 8, 8, 3))
    params = model.init(jax.random.PRNGKey(1), x[:1])
    p = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
    fn = logit_dp.clipped_grad(model.apply, LOSSES["contrastive"], 1.0, method="ghost")
    compiled = fn.core.lower(params, x, x, jnp.ones((n,), bool)).compile()
    temp[n] = compiled.memory_analysis().temp_size_in_bytes / 4
    plan = layerwise.make_plan(model.apply, params, x, d)
    pair_chunk = sum(
        min(chunk_budget, n * n * (layer.positions ** 2 + 2 * layer.positions * layer.features + d))
        for layer, ghost in zip(plan.layers, plan.ghost) if ghost)
    # Both views' Jacobians + the cross-Gram + one chunk of ghost-layer pair terms.
    budget[n] = 2 * n * d * p + n * n * d * d + pair_chunk
  assert temp[256] - temp[64] < 2 * (budget[256] - budget[64]), (temp, budget)
  # At n = 256 (n ≫ d) that is an order of magnitude below one n²·p buffer.
  assert temp[256] < 256 * 256 * p / 10, (temp, 256 * 256 * p)
