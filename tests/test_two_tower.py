"""Two-tower (dual-encoder) Logit-DP: x embedded by embed_fn, x' by positive_embed_fn.

Checked against independent computations: jax.grad of the loss, jax.grad of each Z_ij in
float64, and Algorithm 1 ("materialize"); with pytree inputs (token ids and a padding
mask), masks and microbatches; disjoint and shared towers; and the stress family
(near-aligned embeddings, tiny B).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from helpers import flat
from helpers import float32_jacobian_norms
from helpers import make_batch
from helpers import rel_err
from logit_dp import audit
from logit_dp import distributed
from logit_dp._src import numerics

# "projected" supports one tower only (a ValueError: test_projected.py).
TWO_TOWER_METHODS = tuple(m for m in logit_dp.clip_methods.METHODS if m != "projected")

N, D, VOCAB, LENGTH = 8, 4, 9, 3
LOSS = logit_dp.losses.contrastive(temperature=1.0)
KINDS = ("disjoint", "shared")
STRESS = ("aligned_disjoint", "aligned_shared")


class ImageTower(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(D)(nn.tanh(nn.Dense(6)(x)))


class TextTower(nn.Module):
  """Bag of words: masked mean of token embeddings, then a dense layer."""
  @nn.compact
  def __call__(self, tokens):
    e = nn.Embed(VOCAB, 5)(tokens["ids"])
    m = tokens["mask"][..., None].astype(jnp.float32)
    return nn.Dense(D)(nn.tanh(jnp.sum(e * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)))


def _texts(key, n):
  ids = jax.random.randint(key, (n, LENGTH), 0, VOCAB)
  lengths = 1 + jnp.arange(n) % LENGTH
  return {"ids": ids, "mask": jnp.arange(LENGTH)[None, :] < lengths[:, None]}


def _towers(kind: str, seed: int = 0, n: int = N):
  """(embed_fn, positive_embed_fn, params, x, x_prime).

  disjoint: image MLP and text tower, no common leaf. shared: both end in one shared
  dense head. aligned_*: two copies of the same MLP (values equal, leaves separate; in
  aligned_shared the last layer is one shared leaf) on x' = x + 10⁻²·noise, so that
  û_i ≈ v̂_i and the positive pair gradients are tiny (nearly cancelling when shared).
  """
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  image, text, head = ImageTower(), TextTower(), nn.Dense(D)
  x = jax.random.normal(k[0], (n, 5))
  if kind in KINDS:
    tokens = _texts(k[1], n)
    params = {
        "image": image.init(k[2], x[:1])["params"],
        "text": text.init(k[3], jax.tree_util.tree_map(lambda a: a[:1], tokens))["params"]
    }
    if kind == "disjoint":
      return (lambda p, xs: image.apply({"params": p["image"]}, xs),
              lambda p, ts: text.apply({"params": p["text"]}, ts), params, x, tokens)
    params["head"] = head.init(k[4], jnp.zeros((1, D)))["params"]
    f = lambda p, xs: head.apply({"params": p["head"]},
                                 jnp.tanh(image.apply({"params": p["image"]}, xs)))
    g = lambda p, ts: head.apply({"params": p["head"]},
                                 jnp.tanh(text.apply({"params": p["text"]}, ts)))
    return f, g, params, x, tokens
  x_prime = x + 1e-2 * jax.random.normal(k[1], x.shape)
  first, last = nn.Dense(6), nn.Dense(D)
  p1 = first.init(k[2], x[:1])["params"]
  p2 = last.init(k[3], jnp.zeros((1, 6)))["params"]
  tower = lambda a, b, xs: last.apply({"params": b}, jnp.tanh(first.apply({"params": a}, xs)))
  copy = lambda tree: jax.tree_util.tree_map(jnp.array, tree)  # equal values, separate leaves
  if kind == "aligned_disjoint":
    params = {"a1": p1, "a2": p2, "b1": copy(p1), "b2": copy(p2)}
    return (lambda p, xs: tower(p["a1"], p["a2"], xs), lambda p, xs: tower(p["b1"], p["b2"], xs),
            params, x, x_prime)
  params = {"a1": p1, "b1": copy(p1), "head": p2}
  return (lambda p, xs: tower(p["a1"], p["head"], xs), lambda p, xs: tower(p["b1"], p["head"], xs),
          params, x, x_prime)


def _to64(tree):
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


@functools.cache
def _truth(kind: str) -> np.ndarray:
  return _float64_truth(*_towers(kind))


def _float64_truth(f, g, params, x, x_prime, eps=logit_dp.losses.DEFAULT_COSINE_EPS):
  """‖∇_w Z_ij‖ in float64 by jax.grad of each Z_ij (no library code)."""
  with jax.enable_x64(True):
    p64, x64, xp64 = _to64(params), _to64(x), _to64(x_prime)

    def unit(fn, p, xs, i):
      u = fn(p, jax.tree_util.tree_map(lambda a: a[i][None], xs))[0]
      return u / jnp.sqrt(jnp.sum(u * u) + eps * eps)

    def norm(i, j):
      grad = jax.grad(lambda p: jnp.dot(unit(f, p, x64, i), unit(g, p, xp64, j)))(p64)
      return jnp.sqrt(sum(jnp.sum(leaf * leaf) for leaf in jax.tree_util.tree_leaves(grad)))

    rows, cols = jnp.meshgrid(jnp.arange(N), jnp.arange(N), indexing="ij")
    return np.asarray(jax.jit(jax.vmap(jax.vmap(norm)))(rows, cols))


def _reference(f, g, params, x, x_prime, keep):
  """jax.grad of ℒ(Z(w)) on the kept pairs: the unclipped gradient."""
  take = lambda tree: jax.tree_util.tree_map(lambda a: a[keep], tree)

  def total(p):
    return LOSS(logit_dp.losses.cosine_similarity(f(p, take(x)), g(p, take(x_prime))))

  return jax.value_and_grad(total)(params)


def _batch(f, g, params, x, x_prime):
  return make_batch(f, params, x, x_prime, positive_embed_fn=g)


@functools.cache
def _tower_jacobian_norms(kind: str) -> tuple[np.ndarray, np.ndarray]:
  f, g, params, x, x_prime = _towers(kind)
  return float32_jacobian_norms(f, params, x, x_prime, positive_embed_fn=g)


@pytest.mark.slow  # the shared-parameter path is checked against jax.grad by default above
def test_shared_parameters_are_found_by_tracing():
  f, g, params, x, tokens = _towers("disjoint")
  assert logit_dp.clip_methods.shared_parameters(f, g, params, x, tokens) == []
  f, g, params, x, tokens = _towers("shared")
  assert logit_dp.clip_methods.shared_parameters(
      f, g, params, x, tokens) == ["['head']['bias']", "['head']['kernel']"]
  assert _batch(f, g, params, x, tokens).tower_plans.shared  # what the gradient uses


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind, method",
    [pytest.param(kind, method, marks=SLOW) for kind in KINDS for method in TWO_TOWER_METHODS])
def test_infinite_clip_norm_is_jax_grad_with_mask_and_microbatches(kind, method):
  f, g, params, x, tokens = _towers(kind)
  mask = jnp.array([1, 1, 0, 1, 1, 1, 0, 1], bool)
  keep = np.flatnonzero(np.asarray(mask))
  ref_loss, ref_grads = _reference(f, g, params, x, tokens, keep)
  fn = logit_dp.clipped_grad(f, LOSS, jnp.inf, method, microbatch_size=3, positive_embed_fn=g)
  value, grads = fn(params, x.at[2].set(jnp.nan), tokens, mask)  # masked rows must not leak
  np.testing.assert_allclose(value, ref_loss, rtol=1e-5)
  assert rel_err(grads, ref_grads) < 1e-5


def _one_microbatch_grads(method, clip_norm, microbatch_size):
  f, g, params, x, tokens = _towers("disjoint")
  mask = jnp.array([1, 1, 0, 1, 1, 1, 0, 1], bool)
  fn = logit_dp.clipped_grad(f, LOSS, clip_norm, method, microbatch_size=microbatch_size,
                             positive_embed_fn=g)
  return fn(params, x.at[2].set(jnp.nan), tokens, mask)[1]  # a NaN in a masked row


@pytest.mark.parametrize("method", ["ghost", pytest.param("triangle", marks=pytest.mark.extended)])
def test_one_microbatch_embeds_with_the_factors_and_contracts_them_into_the_gradient(
    method, monkeypatch):
  """Disjoint towers in one microbatch take their embeddings from the passes that form their
  Jacobian factors and ḡ from those factors, with no forward or backward pass of either tower
  of its own: at B = ∞ it is jax.grad's gradient, the NaN of a masked row selected out."""
  from logit_dp._src import pair_batch
  f, g, params, x, tokens = _towers("disjoint")
  keep = np.flatnonzero(np.array([1, 1, 0, 1, 1, 1, 0, 1], bool))
  _, ref_grads = _reference(f, g, params, x, tokens, keep)
  for name in ("_embed", "_backward_pass"):
    monkeypatch.setattr(pair_batch.PairBatch, name,
                        lambda *args, name=name, **kwargs: pytest.fail(f"{name} in one microbatch"))
  assert rel_err(_one_microbatch_grads(method, jnp.inf, None), ref_grads) < 1e-5


@pytest.mark.extended
@pytest.mark.parametrize("method", ["ghost", "triangle"])
def test_one_microbatch_and_microbatches_give_the_same_clipped_gradient(method):
  """ḡ from the factors (one microbatch) and from backward passes (microbatches of 3) at a B
  that clips about half of the pairs."""
  f, g, params, x, tokens = _towers("disjoint")
  clip_norm = float(
      jnp.median(
          logit_dp.clip_methods.pair_grad_norms(f, params, x, tokens, "materialize",
                                                positive_embed_fn=g)))
  whole, chunked = (_one_microbatch_grads(method, clip_norm, m) for m in (None, 3))
  assert rel_err(whole, chunked) < 1e-5
  assert rel_err(whole, _one_microbatch_grads(method, jnp.inf, None)) > 1e-2  # clipping happened


# By default the disjoint towers; the shared ones run by default in
# test_tiny_clip_norm_on_aligned_towers_respects_the_sensitivity[aligned_shared-ghost].
@pytest.mark.parametrize("kind, method", [
    pytest.param(
        kind, method, marks=SLOW if kind not in STRESS else () if
        (kind, method) == ("aligned_disjoint", "ghost") else pytest.mark.extended)
    for kind in KINDS + STRESS for method in TWO_TOWER_METHODS
])
def test_clip_norms_are_never_below_the_float64_truth(kind, method):
  f, g, params, x, x_prime = _towers(kind)
  truth = _truth(kind)
  got = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(f, params, x, x_prime, method, microbatch_size=3,
                                            positive_embed_fn=g), np.float64)
  assert np.all(got >= truth * (1 - 2.0 ** -23)), np.min(got / truth)
  s_u, s_v = _tower_jacobian_norms(kind)
  scale = s_u[:, None] + s_v[None, :]
  diagonal = np.eye(N, dtype=bool)
  # The diagonal from vectors is exact up to the vector allowance, in every method.
  vector = numerics.VECTOR_FLOAT_ERROR * scale
  # An allowance covers the float32 error it is added to, so the excess is at most twice it.
  assert np.all(got[diagonal] <= truth[diagonal] + 2.02 * vector[diagonal])
  exact = method != "triangle" or kind in ("disjoint", "aligned_disjoint")
  if exact:  # disjoint towers: exact at triangle's cost; ghost and materialize: exact
    allowance = (numerics.GRAM_FLOAT_ERROR ** 0.5 + numerics.VECTOR_FLOAT_ERROR) * scale
    assert np.all(got <= truth + 2.02 * allowance)
  else:  # the triangle bound, strictly above the truth somewhere
    assert np.any(got[~diagonal] > 1.01 * truth[~diagonal])


@SLOW
@pytest.mark.parametrize("kind", KINDS)
def test_ghost_and_triangle_match_materialize_with_clipping(kind, no_float_allowance):
  f, g, params, x, tokens = _towers(kind, seed=1)
  exact = logit_dp.clip_methods.pair_grad_norms(f, params, x, tokens, "materialize",
                                                positive_embed_fn=g)
  clip_norm = float(jnp.median(exact))  # about half of the pairs are clipped
  mask = jnp.array([1, 1, 1, 1, 0, 1, 1, 1], bool)
  grads = {
      method:
          logit_dp.clipped_grad(f, LOSS, clip_norm, method, microbatch_size=5, positive_embed_fn=g)
          (params, x, tokens, mask)[1] for method in TWO_TOWER_METHODS
  }
  assert rel_err(grads["ghost"], grads["materialize"]) < 1e-4
  if kind == "disjoint":  # exact norms: the same clipped gradient
    assert rel_err(grads["triangle"], grads["materialize"]) < 1e-4
  _, unclipped = _reference(f, g, params, x, tokens, np.flatnonzero(np.asarray(mask)))
  assert rel_err(grads["materialize"], unclipped) > 1e-2  # clipping happened


@SLOW
def test_a_leaf_used_outside_a_layer_by_the_other_tower_is_shared():
  """The text tower reads a bias of the image tower's first layer with plain jnp: detected as
  shared (the layer is flattened in the image tower, the leaf generic in the text tower)."""
  f, g0, params, x, tokens = _towers("disjoint", seed=2)
  g = lambda p, ts: g0(p, ts) * (1.0 + jnp.tanh(jnp.sum(p["image"]["Dense_0"]["bias"]) + 0.3))
  batch = _batch(f, g, params, x, tokens)
  names = [
      jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  assert [names[i] for i in batch.tower_plans.shared] == ["['image']['Dense_0']['bias']"]
  norms = {}
  for method in ("ghost", "materialize"):
    norms[method] = np.asarray(
        logit_dp.clip_methods.pair_grad_norms(f, params, x, tokens, method, positive_embed_fn=g,
                                              float_allowance=False))
  np.testing.assert_allclose(norms["ghost"], norms["materialize"], rtol=1e-4)


@pytest.mark.extended
@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=() if m == "ghost" else SLOW) for m in TWO_TOWER_METHODS])
def test_one_tower_written_as_two_gives_the_one_tower_norms(method):
  """positive_embed_fn = a copy of embed_fn: every leaf shared, the general path must agree
  with the one-tower computation."""
  f, _, params, x, x_prime = _towers("aligned_shared")
  g = lambda p, xs: f(p, xs)
  one = logit_dp.clip_methods.pair_grad_norms(f, params, x, x_prime, method)
  two = logit_dp.clip_methods.pair_grad_norms(f, params, x, x_prime, method, positive_embed_fn=g)
  # The two paths sum the same terms in different orders (rtol, and atol for the float32
  # rounding of the tiny positive norms, ~1e-4); a flagged pair one tower forms as a vector from
  # its factors carries the vector allowance 2⁻¹⁸·S_ij (~3e-5 here), two towers form it in
  # float64 (docs/privacy_floating_point.md).
  s_u, s_v = float32_jacobian_norms(f, params, x, x_prime)
  allowance = numerics.VECTOR_FLOAT_ERROR * (s_u[:, None] + s_v[None, :])
  one, two = np.asarray(one, np.float64), np.asarray(two, np.float64)
  assert np.all(np.abs(two - one) <= 1e-5 * np.abs(one) + 1e-7 + 1.01 * allowance)


# By default the shared towers; the disjoint ones' norms are checked by default in
# test_clip_norms_are_never_below_the_float64_truth[aligned_disjoint-ghost].
@pytest.mark.parametrize("kind, method", [
    pytest.param(
        kind, method, marks=SLOW if method != "ghost" else
        () if kind == "aligned_shared" else pytest.mark.extended) for kind in STRESS
    for method in TWO_TOWER_METHODS
])
def test_tiny_clip_norm_on_aligned_towers_respects_the_sensitivity(kind, method):
  f, g, params, x, x_prime = _towers(kind)
  result = audit.max_removal_ratio(f, params, LOSS, 1e-5, x, x_prime, method=method,
                                   positive_embed_fn=g)
  assert result.ratio <= 1.0, result.ratio


@SLOW
def test_stress_is_real_positive_pairs_are_tiny():
  """The aligned family puts the positive pair norms far below the others (float64 truth)."""
  for kind in STRESS:
    truth = _truth(kind)
    off = truth[~np.eye(N, dtype=bool)]
    assert np.max(np.diag(truth)) < 0.05 * np.median(off), kind


@pytest.mark.extended
def test_input_errors_are_clear():
  f, g, params, x, tokens = _towers("disjoint")
  fn = logit_dp.clipped_grad(f, LOSS, 1.0, positive_embed_fn=g)
  bad = dict(tokens, mask=tokens["mask"][:-1])
  with pytest.raises(ValueError, match=r"every leaf of x_prime .* same number of examples"):
    fn(params, x, bad)
  with pytest.raises(ValueError, match="same number of examples"):
    fn(params, x[:-1], tokens)
  with pytest.raises(ValueError, match="numbers"):
    fn(params, x, dict(tokens, ids=np.array(["a"] * N)))
  with pytest.raises(ValueError, match="scalar"):
    fn(params, x, dict(tokens, length=3))
  with pytest.raises(ValueError, match="callable"):
    logit_dp.clipped_grad(f, LOSS, 1.0, positive_embed_fn="text")
  wide = lambda p, ts: jnp.concatenate([g(p, ts), g(p, ts)], axis=1)
  with pytest.raises(ValueError, match="same dimension"):
    logit_dp.clipped_grad(f, LOSS, 1.0, positive_embed_fn=wide)(params, x, tokens)
  mixing = lambda p, ts: g(p, ts) - jnp.mean(g(p, ts), axis=0)
  with pytest.raises(ValueError, match="positive_embed_fn mixes the examples"):
    logit_dp.clipped_grad(f, LOSS, 1.0, positive_embed_fn=mixing)(params, x, tokens)


@SLOW
def test_sharded_two_towers_match_one_device():
  f, g, params, x, tokens = _towers("shared", seed=3, n=7)
  mask = jnp.array([1, 1, 1, 0, 1, 1, 1], bool)
  expected = logit_dp.clipped_grad(f, LOSS, 0.2, positive_embed_fn=g)(params, x, tokens, mask)
  mesh = distributed.data_mesh(4)
  xs, ts, ms = distributed.pad_to_multiple(np.asarray(x),
                                           jax.tree_util.tree_map(np.asarray, tokens),
                                           np.asarray(mask), 4)
  assert ts["ids"].shape[0] == 8
  got = distributed.make_sharded_grad_fn(f, LOSS, 0.2, mesh, positive_embed_fn=g)(params, xs, ts,
                                                                                  ms)
  np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
  assert rel_err(got[1], expected[1]) < 1e-4


@SLOW
def test_make_private_and_naive_take_two_towers():
  f, g, params, x, tokens = _towers("disjoint")
  private = logit_dp.make_private(f, LOSS, 0.5, target_epsilon=4.0, target_delta=1e-5,
                                  num_records=1000, expected_batch_size=N, steps=10,
                                  optimizer=optax.sgd(0.1), noise_key=jax.random.key(0),
                                  sampler_seed=0, method="triangle", positive_embed_fn=g)
  assert private.sensitivity == logit_dp.sensitivity(LOSS, 0.5, batch_size=None)
  _, grads = private.grad_fn(params, x, tokens)
  state = private.optimizer.init(params)
  updates, _ = private.optimizer.update(grads, state, params)
  assert np.all(np.isfinite(flat(updates)))
  ref_loss, ref_grads = _reference(f, g, params, x, tokens, np.arange(N))
  value, naive = logit_dp.baselines.naive_clipped_grad(f, LOSS, jnp.inf,
                                                       positive_embed_fn=g)(params, x, tokens)
  np.testing.assert_allclose(value, ref_loss, rtol=1e-5)
  assert rel_err(naive, ref_grads) < 1e-5


@SLOW
def test_pytree_inputs_with_one_tower():
  """One tower on a pytree input (an image and a per-example scale): same as the array input."""
  f, _, params, x, _ = _towers("aligned_disjoint")
  scale = 1.0 + jnp.arange(N, dtype=jnp.float32) / N
  tree_fn = lambda p, xs: f(p, xs["image"] * xs["scale"][:, None])
  fn_tree = logit_dp.clipped_grad(tree_fn, LOSS, 0.3, microbatch_size=3)
  fn_array = logit_dp.clipped_grad(f, LOSS, 0.3, microbatch_size=3)
  x_prime = x[::-1]
  got = fn_tree(params, {"image": x, "scale": scale}, {"image": x_prime, "scale": jnp.ones(N)})
  want = fn_array(params, x * scale[:, None], x_prime)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  assert rel_err(got[1], want[1]) < 1e-5
