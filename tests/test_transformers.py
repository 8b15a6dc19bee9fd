"""Transformer encoders (text, ViT, their CLIP pair) in flax.linen, flax.nnx, Equinox and plain
einsum: every clip method runs on them, ghost's norms and ḡ are float64 truth, the reference
method uses nothing but JAX's differentiation, and `describe_plan` says how every parameter is
handled."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from benchmarks import transformers
from helpers import flat
from helpers import float64_clipped_reference
from logit_dp._src import layers
from logit_dp._src import layerwise
from logit_dp._src import linear_ops
from logit_dp._src import plan_report

TINY = dict(width=8, depth=1, num_heads=2, mlp_dim=16, length=4, vocab_size=20, image_side=8,
            patch_size=4, embedding_dim=4)
N = 4
LOSS = logit_dp.losses.contrastive(temperature=0.5)


@functools.cache
def _problem(framework, arch):
  return transformers.build(framework, arch, N, **TINY)


def _assert_float64_truth(norms, truth):
  """float32 Gram forms lose ~1e-7·max² to cancellation (as in test_frameworks)."""
  np.testing.assert_allclose(norms, truth, rtol=1e-4, atol=1e-5 * float(np.max(truth)))


def _cases(default):
  return [(f, a) if (f, a) in default else pytest.param(f, a, marks=pytest.mark.extended)
          for a in transformers.ARCHS for f in transformers.FRAMEWORKS]


@functools.cache
def _float64_norms(framework, arch):
  """The float64 pair norms of a one-tower problem, read-only (shared by the tests)."""
  embed_fn, params, x, x_prime, _ = _problem(framework, arch)
  with jax.enable_x64(True):
    truth, _ = float64_clipped_reference(embed_fn, LOSS, params, x, x_prime, np.inf)
  truth = np.array(truth)
  truth.setflags(write=False)
  return truth


def _clip_by_and_reference(embed_fn, params, x, x_prime, positive):
  """The float64 pair norms, a B between them, and the float64 ḡ clipped by the true norms
  (one tower: helpers.float64_clipped_reference; two towers: each pair's jax.grad here)."""
  with jax.enable_x64(True):
    if positive is None:
      truth, _ = float64_clipped_reference(embed_fn, LOSS, params, x, x_prime, np.inf)
      clip_norm = float(np.median(truth))
      _, grad = float64_clipped_reference(embed_fn, LOSS, params, x, x_prime, clip_norm)
      return truth, clip_norm, jax.tree_util.tree_map(np.asarray, grad)
    p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    x64 = x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x
    unit = lambda e: e / jnp.sqrt(jnp.sum(e * e) + 1e-12)
    z = lambda p, i, j: jnp.dot(unit(embed_fn(p, x64[i:i + 1])[0]),
                                unit(positive(p, x_prime[j:j + 1])[0]))
    grads = [[jax.grad(z)(p64, i, j) for j in range(N)] for i in range(N)]
    truth = np.array([[
        np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree_util.tree_leaves(grads[i][j])))
        for j in range(N)
    ] for i in range(N)])
    u = jnp.stack([unit(embed_fn(p64, x64[i:i + 1])[0]) for i in range(N)])
    v = jnp.stack([unit(positive(p64, x_prime[j:j + 1])[0]) for j in range(N)])
    tau = np.asarray(jax.grad(LOSS)(u @ v.T, jnp.ones((N,), bool)))
    clip_norm = float(np.median(truth))
    lam = tau * np.minimum(1.0, clip_norm / truth)
    grad = jax.tree_util.tree_map(lambda *g: sum(w * np.asarray(a) for w, a in zip(lam.ravel(), g)),
                                  *[grads[i][j] for i in range(N) for j in range(N)])
    return truth, clip_norm, grad


# Every case extended: ghost's norms on the linen text transformer are float64 truth in
# test_an_operation_the_engine_cannot_read_takes_the_exact_slow_path, ghost's ḡ against the
# float64 reference (on an MLP) in test_clipping.py::test_infinite_clip_norm_is_jax_grad.
@pytest.mark.parametrize("framework,arch", _cases(set()))
def test_ghost_norms_and_gradient_are_float64_truth(framework, arch):
  embed_fn, params, x, x_prime, positive = _problem(framework, arch)
  truth, clip_norm, expected = _clip_by_and_reference(embed_fn, params, x, x_prime, positive)
  ghost = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost",
                                            float_allowance=False, positive_embed_fn=positive))
  _assert_float64_truth(ghost, truth)
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm, "ghost", positive_embed_fn=positive)
  _, grad = grad_fn(params, x, x_prime)
  # ḡ is clipped by the norms with their float allowance, a relative 1e-5 or so above truth.
  np.testing.assert_allclose(flat(grad), flat(expected), rtol=0,
                             atol=2e-4 * float(np.max(np.abs(flat(expected)))))


def test_a_disjoint_towers_layers_keep_their_factors_where_their_gram_is_cheaper_so():
  """No cross term involves a CLIP tower's own layers: each stays as its factors when its
  per-example Gram costs less from them, even where a shared layer's pair cost would flatten it
  (the ViT's), and ghost's norms and ḡ are the float64 truth."""
  from logit_dp._src import two_tower  # pylint: disable=g-import-not-at-top
  embed_fn, params, x, x_prime, positive = _problem("linen", "clip")
  d = int(embed_fn(params, x).shape[-1])
  plans = two_tower.tower_plans(embed_fn, positive, params, x, x_prime, d)
  assert not plans.shared
  for plan in (plans.anchor, plans.positive):
    assert plan.ghost == tuple(layerwise.use_ghost_alone(layer, d) for layer in plan.layers)
  assert any(g and not layerwise.use_ghost(layer, d) and layer.positions > 1
             for plan in (plans.anchor, plans.positive)
             for layer, g in zip(plan.layers, plan.ghost))
  truth, clip_norm, expected = _clip_by_and_reference(embed_fn, params, x, x_prime, positive)
  ghost = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost",
                                            float_allowance=False, positive_embed_fn=positive))
  _assert_float64_truth(ghost, truth)
  _, grad = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm, "ghost",
                                  positive_embed_fn=positive)(params, x, x_prime)
  np.testing.assert_allclose(flat(grad), flat(expected), rtol=0,
                             atol=2e-4 * float(np.max(np.abs(flat(expected)))))


@pytest.mark.parametrize("framework,arch", _cases({("linen", "text")}))
def test_no_parameter_of_a_transformer_takes_the_jacrev_route(framework, arch):
  embed_fn, params, x, x_prime, positive = _problem(framework, arch)
  report = logit_dp.clip_methods.describe_plan(embed_fn, params, x, x_prime=x_prime,
                                               positive_embed_fn=positive)
  assert report.slow == ()
  routes = {leaf.path: leaf.route for leaf in report.leaves}
  embedding = [path for path in routes if "embed" in path.lower() and "kernel" not in path]
  norms = [path for path in routes if ("norm" in path.lower() or "Norm" in path)]
  assert bool(embedding) == (arch != "vit")  # a lookup table: factored as a layer
  assert all(routes[path] in ("ghost", "flattened") for path in embedding)
  assert norms and all(routes[path] == "elementwise" for path in norms)
  assert len(report.leaves) == len(jax.tree_util.tree_leaves(params))
  assert str(report).splitlines()[0].split()[:3] == ["parameter", "size", "route"]


def test_dp_gcl_keeps_a_layer_as_factors_up_to_four_times_its_gradient():
  """DP-GCL's group norms keep every token layer of the text encoder (and its embedding table)
  as factors, T·(P + C) ≤ 4·P·C floats per example, where the pair norms' rule at d = 1
  flattens them; so are the ViT's 65-token layers (factors 2.0× the gradient). The paper's
  embedding net's first convolution (T = 256 positions of 28 inputs, 8 features: 41×) is
  flattened. describe_plan(method="dp_gcl") reports DP-GCL's routes."""
  embed_fn, params, x, _, _ = transformers.build("linen", "text", 4)
  plan = layerwise.make_plan(embed_fn, params, x, 1, layerwise.keeps_group_factors)
  assert all(plan.ghost) and {layer.kind for layer in plan.layers} == {"dense", "embed"}
  for layer in plan.layers:
    assert (layer.positions * (layer.fan_in + layer.features)
            <= 4 * layer.fan_in * layer.features)  # the rule, written out
  report = logit_dp.clip_methods.describe_plan(embed_fn, params, x, method="dp_gcl")
  assert {leaf.route for leaf in report.leaves} == {"ghost", "elementwise"}
  assert report.embedding_dim == 32 and all(leaf.pair_cost == 0 for leaf in report.leaves)
  assert "DP-GCL's group norms: no pair terms" in str(report)
  # The pair norms' rule (a cost per pair) at d = 1 flattens the token layers: a P·C-float
  # gradient per example.
  assert not any(layerwise.make_plan(embed_fn, params, x, 1).ghost[:-1])

  vit_fn, vit_params, images, _, _ = transformers.build("linen", "vit", 2)
  assert all(
      layerwise.make_plan(vit_fn, vit_params, images, 1, layerwise.keeps_group_factors).ghost)

  net = logit_dp.models.EmbeddingNet()
  images = jnp.zeros((2, 32, 32, 3))
  net_params = net.init(jax.random.key(0), images[:1])
  net_plan = layerwise.make_plan(net.apply, net_params, images, 1, layerwise.keeps_group_factors)
  first = net_plan.layers[0]
  assert (first.kind, first.positions, first.fan_in, first.features) == ("conv", 256, 28, 8)
  assert not net_plan.ghost[0] and net_plan.ghost[-1]
  with pytest.raises(ValueError, match="method must be"):
    logit_dp.clip_methods.describe_plan(embed_fn, params, x, method="dp-gcl")


@pytest.mark.extended
def test_linen_rms_norm_and_conv_take_the_fast_path_with_float64_truth():
  """flax.linen's RMSNorm (a scale only) after a patch convolution and a DenseGeneral over two
  axes: no leaf on the slow path, ghost's norms and ḡ are the float64 truth."""
  import flax.linen as nn

  class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Conv(8, (4, 4), strides=4)(x)  # (n, 2, 2, 8) patches
      h = nn.RMSNorm()(h.reshape(h.shape[0], 4, 8))
      h = nn.DenseGeneral(features=4, axis=(-2, -1))(jnp.tanh(h))
      return h

  model = Encoder()
  x = jax.random.normal(jax.random.key(0), (N, 8, 8, 3))
  x_prime = x + 0.1 * jax.random.normal(jax.random.key(1), x.shape)
  params = model.init(jax.random.key(2), x[:1])
  report = logit_dp.clip_methods.describe_plan(model.apply, params, x)
  assert report.slow == ()
  routes = {leaf.path: leaf.route for leaf in report.leaves}
  assert routes["['params']['RMSNorm_0']['scale']"] == "elementwise"
  truth, clip_norm, expected = _clip_by_and_reference(model.apply, params, x, x_prime, None)
  ghost = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(model.apply, params, x, x_prime, "ghost",
                                            float_allowance=False))
  _assert_float64_truth(ghost, truth)
  _, grad = logit_dp.clipped_grad(model.apply, LOSS, clip_norm)(params, x, x_prime)
  np.testing.assert_allclose(flat(grad), flat(expected), rtol=0,
                             atol=2e-4 * float(np.max(np.abs(flat(expected)))))


@pytest.mark.parametrize("method", [
    pytest.param("ghost", marks=pytest.mark.extended),
    pytest.param("projected", marks=pytest.mark.extended),
    pytest.param("triangle", marks=pytest.mark.extended),
    pytest.param("materialize", marks=pytest.mark.extended)
])
def test_every_method_runs_on_the_linen_transformer_and_bounds_the_truth(method):
  embed_fn, params, x, x_prime, _ = _problem("linen", "text")
  truth = _float64_norms("linen", "text")
  if method == "projected":  # public reference token ids, drawn apart from the batch
    method = logit_dp.clip_methods.Projected(
        reference_inputs=jax.random.randint(jax.random.key(7), (
            4, TINY["length"]), 0, TINY["vocab_size"]))
  norms = np.asarray(logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, method))
  assert np.all(np.isfinite(norms)) and np.all(norms >= truth * (1 - 1e-6))
  _, grad = logit_dp.clipped_grad(embed_fn, LOSS, 1.0, method)(params, x, x_prime)
  assert np.all(np.isfinite(flat(grad)))


@pytest.mark.extended
def test_materialize_uses_nothing_but_jax_differentiation(monkeypatch):
  embed_fn, params, x, x_prime, _ = _problem("linen", "text")
  truth = _float64_norms("linen", "text")

  def refuse(*args, **kwargs):
    raise AssertionError("the engine was used")

  monkeypatch.setattr(linear_ops, "scan", refuse)
  monkeypatch.setattr(layerwise, "make_plan", refuse)
  norms = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "materialize",
                                            float_allowance=False))
  _assert_float64_truth(norms, truth)


def test_an_operation_the_engine_cannot_read_takes_the_exact_slow_path(monkeypatch):
  embed_fn, params, x, x_prime, _ = _problem("linen", "text")
  truth = _float64_norms("linen", "text")

  def unreadable(*args, **kwargs):
    raise ValueError("an equation of a form the recogniser does not expect")

  monkeypatch.setattr(layers.Dense, "recognise", unreadable)
  report = logit_dp.clip_methods.describe_plan(embed_fn, params, x)
  assert any("query" in leaf.path for leaf in report.slow)
  norms = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost",
                                            float_allowance=False))
  _assert_float64_truth(norms, truth)


@pytest.mark.extended
def test_a_large_parameter_on_the_slow_path_warns_once(monkeypatch):
  monkeypatch.setattr(plan_report, "_warned", set())
  table = jax.random.normal(jax.random.key(0), (64, 80))  # 5,120 floats, used through sin
  params = {"w": table, "head": jnp.ones((80, 4))}
  embed_fn = lambda p, x: jnp.sin(x @ jnp.sin(p["w"])) @ p["head"]
  x = jax.random.normal(jax.random.key(1), (N, 64))
  report = logit_dp.clip_methods.describe_plan(embed_fn, params, x)
  assert [leaf.path for leaf in report.slow] == ["['w']"]
  grad_fn = logit_dp.clipped_grad(embed_fn, LOSS, 1.0)
  with pytest.warns(UserWarning, match=r"\['w'\] \(5,120 floats\) takes the slow path"):
    grad_fn(params, x, x + 0.1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    logit_dp.clipped_grad(embed_fn, LOSS, 1.0)(params, x, x + 0.1)  # warned already


def _private(embed_fn, example=None, **kwargs):
  return logit_dp.make_private(embed_fn, LOSS, 1.0, target_epsilon=1.0, target_delta=1e-5,
                               num_records=64, expected_batch_size=8, optimizer=optax.sgd(0.1),
                               steps=2, example=example, **kwargs)


def test_make_private_with_an_example_checks_the_model_when_the_training_is_built(monkeypatch):
  """What the first step would find is raised (or warned) by make_private(example=...), and
  nothing is checked again at the first step."""
  monkeypatch.setattr(plan_report, "_warned", set())
  table = jax.random.normal(jax.random.key(0), (64, 80))
  params = {"w": table, "head": jnp.ones((80, 4))}
  slow = lambda p, x: jnp.sin(x @ jnp.sin(p["w"])) @ p["head"]
  x = np.asarray(jax.random.normal(jax.random.key(1), (N, 64)))
  with pytest.warns(UserWarning, match=r"\['w'\] \(5,120 floats\) takes the slow path"):
    training = _private(slow, (params, x))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step = training.make_train_step()
    state = training.optimizer.init(params)
    batch = next(iter(training.batches()))
    step(params, state, batch, (np.tile(x, (16, 1)), np.tile(x, (16, 1)) + 0.1))

  mixing = lambda p, x: slow(p, x) - slow(p, x).mean(0)  # batch statistics
  with pytest.raises(ValueError, match="mixes the examples of a batch"):
    _private(mixing, (params, x))
  _private(mixing)  # without an example: found at the first step
  with pytest.raises(ValueError, match=r"structure does not match params[\s\S]*nope"):
    _private(slow, (params, x), trainable={"nope": True})
  with pytest.raises(TypeError, match="example must be"):
    _private(slow, params)


@pytest.mark.extended
@pytest.mark.parametrize("method,kwargs", [("dp_gcl", dict(group_size=2)), ("materialize", {}),
                                           ("ghost", dict(positive_embed_fn="text"))])
def test_make_private_checks_every_method_and_two_towers_from_an_example(method, kwargs):
  if kwargs.get("positive_embed_fn"):
    embed_fn, params, x, x_prime, positive = _problem("linen", "clip")
    kwargs = dict(positive_embed_fn=positive)
  else:
    embed_fn, params, x, x_prime, _ = _problem("linen", "text")
  training = _private(embed_fn, (params, x[:3], x_prime[:3]), method=method, **kwargs)
  assert training.grad_fn._checked  # the first step does not check again
  with pytest.raises(ValueError, match="mixes the examples of a batch"):
    mixing = lambda p, x: embed_fn(p, x) - embed_fn(p, x).mean(0)
    _private(mixing, (params, x[:3], x_prime[:3]), method=method, **kwargs)


@pytest.mark.parametrize("method", [pytest.param("ghost", marks=pytest.mark.extended), "dp_gcl"])
def test_a_mesh_gives_the_single_device_gradient(method):
  """Layer norms, positions and attention inside shard_map: the plan is matched by what each
  layer is, not by its equation's index in the trace (shard_map adds equations before them).
  Both methods evaluate the model through the same plan (`layerwise`); DP-GCL compiles in a
  third of ghost's time, so it is the default case."""
  embed_fn, params, x, x_prime, _ = transformers.build("linen", "text", 8, **TINY)
  mesh = logit_dp.distributed.data_mesh(2)
  extra, kwargs = {}, {}
  if method == "dp_gcl":
    kwargs = dict(num_groups=4)
    extra = dict(record_ids=jnp.arange(8), group_key=jax.random.key(3))
    single = logit_dp.baselines.grouped_clipped_grad(embed_fn, LOSS, 1.0, **kwargs)
  else:
    single = logit_dp.clipped_grad(embed_fn, LOSS, 1.0)
  sharded = logit_dp.distributed.make_sharded_grad_fn(embed_fn, LOSS, 1.0, mesh, method=method,
                                                      **kwargs)
  loss_one, grad_one = single(params, x, x_prime, **extra)
  loss_all, grad_all = sharded(params, x, x_prime, **extra)  # 4 rows on each of 2 devices
  np.testing.assert_allclose(float(loss_all), float(loss_one), rtol=1e-5)
  np.testing.assert_allclose(flat(grad_all), flat(grad_one), rtol=1e-4,
                             atol=1e-5 * float(np.max(np.abs(flat(grad_one)))))


def test_make_private_checks_an_example_on_a_mesh():
  """The example's rows are padded (masked) to a multiple of the mesh's devices."""
  embed_fn, params, x, x_prime, _ = _problem("linen", "text")
  mesh = logit_dp.distributed.data_mesh()
  training = _private(embed_fn, (params, x[:3], x_prime[:3]), mesh=mesh)
  assert training.grad_fn._checked
  with pytest.raises(ValueError, match="mixes the examples of a batch"):
    _private(lambda p, x: embed_fn(p, x) - embed_fn(p, x).mean(0), (params, x[:3]), mesh=mesh)


def test_dense_general_and_einsum_of_several_axes_are_exact():
  """The shapes of the original crash: DenseGeneral(features=(4, 16)) and a plain einsum."""
  import flax.linen as nn

  class Heads(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.DenseGeneral(features=(4, 16))(x)  # (n, 4, 16)
      h = nn.DenseGeneral(features=8, axis=(-2, -1))(jnp.tanh(h))  # contracts both
      return h

  model = Heads()
  x = jax.random.normal(jax.random.key(0), (N, 12))
  params = model.init(jax.random.key(1), x[:1])
  kernel = jax.random.normal(jax.random.key(2), (12, 2, 3))
  plain = lambda p, x: jnp.einsum("nc,chd->nhd", x, p["k"]).reshape(x.shape[0], -1)
  for embed_fn, p in ((model.apply, params), (plain, {"k": kernel})):
    x_prime = x + 0.1 * jax.random.normal(jax.random.key(3), x.shape)
    with jax.enable_x64(True):
      truth, _ = float64_clipped_reference(embed_fn, LOSS, p, x, x_prime, np.inf)
    report = logit_dp.clip_methods.describe_plan(embed_fn, p, x)
    assert report.slow == () and {leaf.route for leaf in report.leaves} <= {"ghost", "flattened"}
    ghost = np.asarray(
        logit_dp.clip_methods.pair_grad_norms(embed_fn, p, x, x_prime, "ghost",
                                              float_allowance=False))
    _assert_float64_truth(ghost, truth)
