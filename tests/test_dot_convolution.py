"""Convolutions as matrix products (the float64 positive pairs): equal to XLA's convolutions.

Each case compares, in float64, a convolution and the gradient of a function of it with respect
to its input and kernel (the two transposed convolutions of the backward pass: an input-dilated
convolution with the flipped kernel, and a convolution of the input by the output cotangent,
with batch groups when the convolution has feature groups) against `lax.conv_general_dilated`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conftest import SmallConv
from logit_dp._src import dot_convolution
from logit_dp._src import numerics
from logit_dp._src import widened

CASES = {
    "nhwc_same":
        dict(strides=(1, 1), padding="SAME", dims=("NHWC", "HWIO", "NHWC")),
    "nhwc_stride2":
        dict(strides=(2, 2), padding="SAME", dims=("NHWC", "HWIO", "NHWC")),
    "nchw_groups_dilated":
        dict(strides=(2, 1), padding=((1, 2), (0, 1)), rhs_dilation=(2, 1),
             dims=("NCHW", "OIHW", "NCHW"), groups=2),
    "depthwise_valid":
        dict(strides=(2, 2), padding="VALID", dims=("NHWC", "HWIO", "NHWC"), groups=4),
    "input_dilated":
        dict(strides=(1, 1), padding=((2, 1), (1, 1)), lhs_dilation=(2, 1),
             dims=("NHWC", "HWIO", "NHWC")),
    "1d":
        dict(strides=(1,), padding="VALID", dims=("NWC", "WIO", "NWC")),
    "3d":
        dict(strides=(1, 2, 1), padding="SAME", dims=("NDHWC", "DHWIO", "NDHWC")),
}


def _operands(case: dict, rng):
  lhs_spec, rhs_spec, _ = case["dims"]
  groups = case.get("groups", 1)
  size = {"N": 2, "C": 4, "O": 8, "I": 4 // groups}
  lhs = rng.normal(size=[size.get(a, 7) for a in lhs_spec])
  rhs = rng.normal(size=[size.get(a, 3) for a in rhs_spec])
  return lhs, rhs


# By default the cases that combine most (feature groups, both dilations, asymmetric padding,
# NCHW); extended, three spatial dimensions; the plainer ones are slow.
DEFAULT_CASES = ("nchw_groups_dilated", "input_dilated")
EXTENDED_CASES = ("3d",)


@pytest.mark.parametrize("name", [
    n if n in DEFAULT_CASES else pytest.param(
        n, marks=pytest.mark.extended if n in EXTENDED_CASES else pytest.mark.slow) for n in CASES
])
def test_convolution_and_its_gradients_equal_xla_in_float64(name):
  case = CASES[name]
  rank = len(case["strides"])
  conv = lambda x, w: lax.conv_general_dilated(x, w, case["strides"], case[
      "padding"], case.get("lhs_dilation", (1,) * rank), case.get("rhs_dilation", (
          1,) * rank), case["dims"], feature_group_count=case.get("groups", 1))

  def f(x, w):  # a cotangent that differs at every output position
    y = conv(x, w)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape))

  with jax.enable_x64(True):
    x, w = _operands(case, np.random.default_rng(0))
    expected = (conv(x, w),) + jax.grad(f, argnums=(0, 1))(x, w)
    rewritten = dot_convolution.convolutions_as_dots(
        lambda x, w: (conv(x, w),) + jax.grad(f, argnums=(0, 1))(x, w))
    got = rewritten(x, w)
    text = jax.jit(rewritten).lower(x, w).as_text()
  assert "stablehlo.convolution" not in text
  for a, b in zip(got, expected):
    assert a.shape == b.shape and a.dtype == jnp.float64
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * np.max(np.abs(b)))


def test_float64_positive_pairs_of_a_conv_model_run_without_convolutions():
  """The float64 pair norms of a convolutional model compile to matrix products only (XLA:CPU
  runs float64 convolutions ~100× slower), and equal its float64 jax.grad norms."""
  model = SmallConv()
  x = jax.random.uniform(jax.random.PRNGKey(0), (4, 8, 8, 3))
  x_prime = x + 1e-2 * jax.random.normal(jax.random.PRNGKey(1), x.shape)
  params = model.init(jax.random.PRNGKey(2), x[:1])

  def pair_grad(p, pair):
    unit = lambda q, e: numerics.normalize(model.apply(q, e[None])[0])
    return jax.grad(lambda q: jnp.dot(unit(q, pair[0]), unit(q, pair[1])))(p)

  norms = lambda p, a, b: widened.pair_norms(pair_grad, p, (a, b), jnp.float32, 2)[0]
  compiled = jax.jit(norms).lower(params, x, x_prime).compile()
  assert " convolution(" not in compiled.as_text()
  got = np.asarray(compiled(params, x, x_prime), np.float64)
  with jax.enable_x64(True):
    p64, x64, xp64 = widened.widen((params, x, x_prime))
    grads = jax.lax.map(lambda ab: pair_grad(p64, ab), (x64, xp64))
    truth = np.sqrt(
        sum(
            np.sum(np.asarray(g).reshape(4, -1) ** 2, -1)
            for g in jax.tree_util.tree_leaves(grads)))
  assert np.all(got >= truth)
  np.testing.assert_allclose(got, truth, rtol=1e-6)
