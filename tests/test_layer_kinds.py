"""Layer kinds: each registered kind factors its layers exactly (float64 truth), and a kind
defined outside the package, for a primitive the engine does not know, is one class and one
`register_layer_kind` line away from the fast path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

import logit_dp
from conftest import make_model
from helpers import flat
from helpers import float64_clipped_reference
from logit_dp._src import layerwise
from logit_dp._src.layers import base

LOSS = logit_dp.losses.contrastive(temperature=0.5)
N = 4


def _embedding_model():
  """Token ids -> table rows (a gather), mean over tokens, a dense head."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"table": jax.random.normal(k1, (11, 6)), "head": jax.random.normal(k2, (6, 3))}
  embed_fn = lambda p, ids: jnp.take(p["table"], ids, axis=0).mean(axis=1) @ p["head"]
  x = jax.random.randint(k3, (N, 5), 0, 11)
  x_prime = jnp.where(jnp.arange(5) < 2, (x + 1) % 11, x)
  return embed_fn, params, x, x_prime


def _problem(kind):
  if kind == "embed":
    return _embedding_model()
  return make_model({"dense": "mlp", "conv": "conv"}[kind], n=N)


def _assert_norms_are_float64_truth(embed_fn, params, x, x_prime):
  with jax.enable_x64(True):
    truth, _ = float64_clipped_reference(embed_fn, LOSS, params, x, x_prime, np.inf)
  norms = np.asarray(
      logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x_prime, "ghost",
                                            float_allowance=False))
  # float32 Gram forms lose ~1e-7·max² to cancellation (as in test_frameworks).
  np.testing.assert_allclose(norms, truth, rtol=1e-4, atol=1e-5 * float(np.max(truth)))


def test_the_built_in_kinds_are_registered_once_each():
  assert set(base.REGISTRY) >= {"dense", "conv", "embed"}
  assert all(isinstance(kind, logit_dp.clip_methods.LayerKind) for kind in base.REGISTRY.values())
  assert base.for_primitive("dot_general") == (base.REGISTRY["dense"],)


@pytest.mark.parametrize(
    "kind",
    [  # dense and conv layers have the frameworks' tests too
        pytest.param("dense", marks=pytest.mark.extended),
        pytest.param("conv", marks=pytest.mark.extended), "embed"
    ])
def test_every_built_in_kind_factors_its_layers_exactly(kind):
  embed_fn, params, x, x_prime = _problem(kind)
  report = logit_dp.clip_methods.describe_plan(embed_fn, params, x)
  assert report.slow == ()
  assert any(kind in leaf.detail for leaf in report.leaves if leaf.route in ("ghost", "flattened"))
  _assert_norms_are_float64_truth(embed_fn, params, x, x_prime)


def test_a_kind_refuses_bad_registrations():
  with pytest.raises(TypeError, match="LayerKind instance"):
    logit_dp.clip_methods.register_layer_kind(_UserMatmul)  # the class, not an instance

  class Nameless(_UserMatmul):
    name = ""

  with pytest.raises(ValueError, match="class attribute name"):
    logit_dp.clip_methods.register_layer_kind(Nameless())

  class Impostor(_UserMatmul):
    name = "dense"

  with pytest.raises(ValueError, match="already registered as 'dense'"):
    logit_dp.clip_methods.register_layer_kind(Impostor())


# A primitive of the user's own (as a hand-written kernel would be): y = a @ w over a's last
# axis. JAX differentiates it exactly; the engine does not know it until its kind is registered.
def _matmul(a, w):
  return jax.lax.dot_general(a, w, (((a.ndim - 1,), (0,)), ((), ())))


user_matmul_p = Primitive("user_matmul")
user_matmul_p.def_impl(_matmul)
user_matmul_p.def_abstract_eval(
    lambda a, w: jax.core.ShapedArray(a.shape[:-1] + w.shape[-1:], a.dtype))
mlir.register_lowering(user_matmul_p, mlir.lower_fun(_matmul, multiple_results=False))
ad.defbilinear(user_matmul_p, lambda ct, a, w: user_matmul_p.bind(ct, w.T),
               lambda ct, a, w: jnp.tensordot(a, ct, axes=(tuple(range(a.ndim - 1)),) * 2))


def _user_matmul_batching(args, dims):
  """vmap: the batch axis first (None: not batched); a batched w takes an einsum."""
  a, w = (v if d is None else jnp.moveaxis(v, d, 0) for v, d in zip(args, dims))
  if dims[1] is None:
    return user_matmul_p.bind(a, w), 0
  spec = "...p,bpc->b...c" if dims[0] is None else "b...p,bpc->b...c"
  return jnp.einsum(spec, a, w), 0


batching.primitive_batchers[user_matmul_p] = _user_matmul_batching


class _UserMatmul(logit_dp.clip_methods.LayerKind):
  """The whole kind: which equations are y[e, t, c] = Σ_p A[e, t, p] K[p, c], and A."""
  name = "user_matmul"
  primitive = "user_matmul"
  kernel_operands = (1,)

  def recognise(self, eqn, path, kernel_position, kernel):
    a, w = (v.aval for v in eqn.invars)
    leaf, index, leaf_shape = kernel
    axes, found = self.kernel_axes(index, leaf_shape)
    if not found or a.ndim < 2 or w.ndim != 2 or not self.all_float32(a, w):
      return None
    return logit_dp.clip_methods.LinearOp(path, self.name, leaf, axes, act_position=0,
                                          act_shape=tuple(a.shape), out_shape=tuple(a.shape[1:-1]) +
                                          (int(w.shape[1]),), fan_in=int(w.shape[0]),
                                          features=int(w.shape[1]),
                                          act_to_rows=tuple(range(a.ndim)),
                                          raw_to_canonical=tuple(range(a.ndim)))

  def patches(self, op, act):
    return act.reshape(act.shape[0], op.positions, op.fan_in)


def _user_model():
  k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
  params = {"w1": 0.5 * jax.random.normal(k1, (5, 8)), "w2": jax.random.normal(k2, (8, 3))}
  embed_fn = lambda p, x: user_matmul_p.bind(jnp.tanh(user_matmul_p.bind(x, p["w1"])), p["w2"]
                                            ).mean(axis=1)
  x = jax.random.normal(k3, (N, 2, 5))  # two positions per example
  return embed_fn, params, x, x + 0.3 * jax.random.normal(k4, x.shape)


def test_a_kind_registered_from_outside_takes_its_primitive_off_the_slow_path(monkeypatch):
  monkeypatch.setattr(base, "REGISTRY", dict(base.REGISTRY))  # undone after the test
  embed_fn, params, x, x_prime = _user_model()
  before = logit_dp.clip_methods.describe_plan(embed_fn, params, x)
  assert {leaf.route for leaf in before.leaves} == {"jacrev"}
  logit_dp.clip_methods.register_layer_kind(_UserMatmul())
  after = logit_dp.clip_methods.describe_plan(embed_fn, params, x)
  assert {leaf.route for leaf in after.leaves} <= {"ghost", "flattened"}
  assert all("user_matmul" in leaf.detail for leaf in after.leaves)
  _assert_norms_are_float64_truth(embed_fn, params, x, x_prime)
  # ḡ from the kind's factors is the float64 sum of the clipped pair gradients.
  with jax.enable_x64(True):
    truth, _ = float64_clipped_reference(embed_fn, LOSS, params, x, x_prime, np.inf)
    clip_norm = float(np.median(truth))
    _, expected = float64_clipped_reference(embed_fn, LOSS, params, x, x_prime, clip_norm)
  _, grad = logit_dp.clipped_grad(embed_fn, LOSS, clip_norm)(params, x, x_prime)
  np.testing.assert_allclose(flat(grad), flat(expected), rtol=0,
                             atol=2e-4 * float(np.max(np.abs(flat(expected)))))


def test_a_model_whose_layers_change_between_traces_is_refused_naming_the_layer(monkeypatch):
  """A plan is made from two traces; a later trace with other layers must never be factored
  with it (a layer without its perturbation would have δ = 0)."""
  k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
  params = {"first": jax.random.normal(k1, (5, 8)), "second": jax.random.normal(k2, (8, 3))}
  state = {"planned": False}

  def embed_fn(p, x):  # Python state: once planned, the first layer is a constant
    first = jnp.ones((5, 8)) if state["planned"] else p["first"]
    return jnp.tanh(x @ first) @ p["second"]

  make_plan = layerwise.make_plan

  def planned_then_changed(*args, **kwargs):
    plan = make_plan(*args, **kwargs)
    state["planned"] = True
    return plan

  monkeypatch.setattr(layerwise, "make_plan", planned_then_changed)
  x = jax.random.normal(k3, (N, 5))
  with pytest.raises(
      RuntimeError, match=r"call 0 was planned as the dense of params\['first'\] "
      r"with output \(8,\) and traced as the dense of params\['second'\]"):
    logit_dp.clip_methods.pair_grad_norms(embed_fn, params, x, x + 0.1, "ghost")
