"""Shared fixtures: tiny embedding models. Eight simulated CPU devices for sharding tests."""

import gc
import importlib.util
import os

NUM_SIMULATED_DEVICES = 8
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The tests' functions are tiny and each is compiled once: on the CPU, LLVM's optimisation of the
# generated code costs more than it saves, so it is off (about a third less CPU time for the
# suite), and fusions are emitted by XLA's elemental emitters instead of its MLIR fusion
# emitters (at this optimisation level they compile in about 40% of the time). XLA's own graph
# passes still run and fast-math stays off. Set either flag in XLA_FLAGS to choose otherwise;
# a GPU build keeps its defaults.
_OPTIMIZATION_FLAG = "--xla_backend_optimization_level"
_FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"
# CPU only: JAX_PLATFORMS unset or "cpu", and no accelerator plugin (CUDA, ROCm: jax_plugins;
# TPU: libtpu) installed.
_CPU_ONLY = (os.environ.get("JAX_PLATFORMS", "") in ("", "cpu")
             and importlib.util.find_spec("jax_plugins") is None
             and importlib.util.find_spec("libtpu") is None)
# Added to XLA_FLAGS that are already set rather than replacing them (or being dropped).
_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICE_COUNT_FLAG not in _flags:
  _flags = f"{_flags} {_DEVICE_COUNT_FLAG}={NUM_SIMULATED_DEVICES}"
if _CPU_ONLY and _OPTIMIZATION_FLAG not in _flags:
  _flags = f"{_flags} {_OPTIMIZATION_FLAG}=0"
if _CPU_ONLY and _FUSION_EMITTERS_FLAG not in _flags:
  _flags = f"{_flags} {_FUSION_EMITTERS_FLAG}=false"
os.environ["XLA_FLAGS"] = _flags.strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

# The references (jax.grad, plain convolutions, ...) at full float32 on every backend: on
# a GPU JAX's default for float32 contractions is TF32, about 3 significant digits.
jax.config.update("jax_default_matmul_precision", "highest")


class MLP(nn.Module):
  features: tuple = (16, 6)

  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for f in self.features[:-1]:
      x = nn.tanh(nn.Dense(f)(x))
    return nn.Dense(self.features[-1])(x)


class SmallConv(nn.Module):
  """The paper's embedding net, narrower: 3×3 stride-2 convs, ReLU, mean pool, dense."""
  channels: tuple = (4, 8)
  dim: int = 5

  @nn.compact
  def __call__(self, x):
    for c in self.channels:
      x = nn.relu(nn.Conv(c, (3, 3), strides=2, kernel_init=nn.initializers.kaiming_normal())(x))
    return nn.Dense(self.dim, kernel_init=nn.initializers.xavier_normal())(x.mean(axis=(1, 2)))


def make_model(kind: str, n: int, seed: int = 0):
  """Returns (embed_fn, params, x, x_prime) for a batch of n pairs."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  if kind == "mlp":
    model, shape = MLP(), (n, 7)
  elif kind == "conv":
    model, shape = SmallConv(), (n, 8, 8, 3)
  else:
    raise ValueError(kind)
  x = jax.random.normal(k1, shape)
  x_prime = x + 0.5 * jax.random.normal(k2, shape)
  params = model.init(k3, x[:1])
  return model.apply, params, x, x_prime


def require_devices(k: int) -> None:
  """Fails unless k devices are visible. On CPU they are the simulated ones this file asks
  XLA for, so fewer means a misconfiguration (an XLA_FLAGS with a smaller device count): a
  failure, never a silent skip. An accelerator backend is skipped with its device count."""
  if jax.device_count() >= k:
    return
  message = (f"needs {k} devices, {jax.default_backend()} has {jax.device_count()} "
             f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
  if jax.default_backend() == "cpu":
    pytest.fail(f"{message}: set {_DEVICE_COUNT_FLAG}={NUM_SIMULATED_DEVICES} or leave it unset.")
  pytest.skip(message)


@pytest.fixture
def no_float_allowance(monkeypatch):
  """Clip norms without the float32 allowances, to compare the methods' exact computations
  (tests/test_float32_norms.py tests the allowances themselves)."""
  from logit_dp._src import numerics
  monkeypatch.setattr(numerics, "GRAM_FLOAT_ERROR", 0.0)
  monkeypatch.setattr(numerics, "VECTOR_FLOAT_ERROR", 0.0)


@pytest.fixture(params=["mlp", "conv"])
def model_kind(request):
  return request.param


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
  """Frees the run's compiled executables before an xdist worker reports that it has finished.
  Its controller then gives the worker 5 s to exit before sending it SIGINT (execnet), and a
  collection of a whole run's executables can take longer: the interrupt then lands in JAX's
  garbage-collection callback and pytest prints it as a PytestUnraisableExceptionWarning."""
  del session
  jax.clear_caches()
  gc.collect()
