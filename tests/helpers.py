"""Tree arithmetic used by the tests, the optional jax_privacy, and the documentation's python
blocks."""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np


def flat(tree) -> np.ndarray:
  return np.concatenate(
      [np.ravel(np.asarray(leaf, np.float64)) for leaf in jax.tree_util.tree_leaves(tree)])


def rel_err(a, b) -> float:
  a, b = flat(a), flat(b)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tree_norm(tree) -> float:
  return float(np.linalg.norm(flat(tree)))


def reference_grad(embed_fn, loss, params, x, x_prime, mask=None):
  """jax.grad of ℒ(Z(w)) directly: the unclipped gradient."""
  import logit_dp

  def total(p):
    return loss(logit_dp.losses.cosine_similarity(embed_fn(p, x), embed_fn(p, x_prime)), mask)

  return jax.value_and_grad(total)(params)


def _reference(x, num_reference: int, seed: int) -> jax.Array:
  """Reference inputs of "projected": uniform, of x's example shape, drawn independently of x."""
  shape = (num_reference,) + tuple(jnp.shape(x)[1:])
  return jax.random.uniform(jax.random.PRNGKey(seed), shape, jnp.float32)


def clip_method(method: str, x, num_reference: int = 4, seed: int = 7):
  """The clip method to test under a name: "projected" with reference inputs (`_reference`) and
  rank 16; any other name as it is."""
  if method != "projected":
    return method
  from logit_dp import clip_methods  # pylint: disable=g-import-not-at-top
  return clip_methods.Projected(reference_inputs=_reference(x, num_reference, seed), rank=16)


def method_kwargs(method: str, x, num_reference: int = 4, seed: int = 7) -> dict:
  """The audits' (`logit_dp.audit`) reference keywords of a method: those of `clip_method`."""
  if method != "projected":
    return {}
  return dict(reference_inputs=_reference(x, num_reference, seed), projection_rank=16)


def clip_norm_in_a_gap(norms: np.ndarray) -> float:
  """A B about the median, halfway between two neighbouring norms far enough apart that the
  float32 allowances cannot move a norm across it."""
  values = np.sort(norms.ravel())
  gaps = np.diff(values) / values[1:]
  quarter = len(gaps) // 4
  best = quarter + np.argmax(gaps[quarter:-quarter])
  assert gaps[best] > 1e-3
  return float((values[best] + values[best + 1]) / 2)


def make_batch(embed_fn, params, x, x_prime, positive_embed_fn=None):
  """The library's internal `pair_batch.PairBatch` for all-valid rows on one device, without
  microbatches (tests that check its factors, norms and projections directly)."""
  import jax.numpy as jnp

  from logit_dp._src import collective
  from logit_dp._src import numerics
  from logit_dp._src import pair_batch

  return pair_batch.PairBatch(embed_fn, params, x, x_prime, jnp.ones(
      (x.shape[0],), bool), eps=numerics.DEFAULT_COSINE_EPS, microbatch_size=None,
                              collective=collective.Collective(None),
                              positive_embed_fn=positive_embed_fn)


def float32_jacobian_norms(embed_fn, params, x, x_prime, positive_embed_fn=None):
  """(s_u, s_v) in float64: the Frobenius norms of the normalised embeddings' Jacobians of x
  and x' (by positive_embed_fn where given: a second tower) as the library computes them in
  float32 (under jit, as in clipped_grad), the scale of its float allowances."""
  from logit_dp._src import pair_terms

  @jax.jit
  def norms(params, x, x_prime):
    batch = make_batch(embed_fn, params, x, x_prime, positive_embed_fn=positive_embed_fn)
    f_v = batch.factors(batch.x_prime, positive=positive_embed_fn is not None)
    return (pair_terms.jacobian_norms(batch.factors(batch.x).gram),
            pair_terms.jacobian_norms(f_v.gram))

  return tuple(np.asarray(s, np.float64) for s in norms(params, x, x_prime))


def save_config_started_before(config, workdir, *fields) -> None:
  """Writes ``config``'s config.json into ``workdir`` without ``fields``: the config.json of a
  run started before those fields existed (what `train.check_resumable` must still accept)."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  from experiments import train  # pylint: disable=g-import-not-at-top
  train.save_config(config, str(workdir))
  path = os.path.join(str(workdir), "config.json")
  with open(path) as f:
    old = json.load(f)
  for k in fields:
    del old[k]
  with open(path, "w") as f:
    json.dump(old, f)


def chi2_interval(k: int, level: float) -> tuple[float, float]:
  """The acceptance interval of the two-sided χ²(k) test at `level`: Σ(z/s)² of k i.i.d.
  N(0, s²) draws falls outside it with probability `level`."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  return float(stats.chi2.ppf(level / 2, k)), float(stats.chi2.isf(level / 2, k))


def chi2_statistic(noise, std: float) -> tuple[float, int]:
  """(Σ(z/std)², k) over every coordinate z of every leaf of `noise` (a pytree or array)."""
  z = flat(noise) / std
  return float(np.sum(z * z)), z.size


def chi2_power(k: int, level: float, std_ratio: float) -> float:
  """P[the two-sided χ²(k) test at `level` for std s rejects] when the true std is
  std_ratio·s: the statistic is then std_ratio²·χ²(k)."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  lo, hi = chi2_interval(k, level)
  r2 = std_ratio ** 2
  return float(stats.chi2.cdf(lo / r2, k) + stats.chi2.sf(hi / r2, k))


def assert_noise_std(noise, std: float, level: float = 1e-6, off_by: float = 0.15,
                     min_power: float = 0.99) -> None:
  """Two-sided χ² test that every coordinate of `noise` is i.i.d. N(0, std²), at `level`
  (its false-alarm probability). It first checks its own power: a std `off_by` too large or
  too small is rejected with probability ≥ min_power."""
  stat, k = chi2_statistic(noise, std)
  for ratio in (1 + off_by, 1 - off_by):
    assert chi2_power(k, level, ratio) >= min_power, (k, ratio, chi2_power(k, level, ratio))
  lo, hi = chi2_interval(k, level)
  assert lo < stat < hi, f"Σz² = {stat:.1f} outside ({lo:.1f}, {hi:.1f}) for k = {k}"


def noise_std_is_rejected(noise, std: float, level: float = 1e-6) -> bool:
  """Whether the χ² test of `assert_noise_std` rejects std (for negative controls)."""
  stat, k = chi2_statistic(noise, std)
  lo, hi = chi2_interval(k, level)
  return not lo < stat < hi


def max_abs_correlation_z(series) -> float:
  """max over pairs of 1-D samples of √(m−3)·|atanh r| (Fisher z of Pearson's r, m the pair's
  common length, the longer one truncated): ≈ |N(0, 1)| for each pair of independent series."""
  worst = 0.0
  for i in range(len(series)):
    for j in range(i + 1, len(series)):
      m = min(series[i].size, series[j].size)
      a, b = np.ravel(series[i])[:m], np.ravel(series[j])[:m]
      r = np.clip(np.corrcoef(a, b)[0, 1], -1 + 1e-15, 1 - 1e-15)
      worst = max(worst, float(np.sqrt(m - 3) * abs(np.arctanh(r))))
  return worst


def independence_threshold(num_pairs: int, level: float = 1e-6) -> float:
  """The Bonferroni bound on max_abs_correlation_z: exceeded with probability ≤ level when
  every pair is independent."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  return float(stats.norm.isf(level / (2 * num_pairs)))


def float64_clipped_reference(embed_fn, loss, params, x, x_prime, clip_norm, clip_by=None,
                              eps: float = 1e-6):
  """(‖∇_w Z_ij‖ (n, n), Σ_ij τ_ij·min(1, B/c_ij)·∇_w Z_ij) in float64 by jax.grad of each Z_ij,
  all rows valid, with c = clip_by or the exact norms when None (call under x64)."""
  widen = lambda a: (jnp.asarray(a, jnp.float64)
                     if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a)  # not token ids
  p64, x64, xp64 = jax.tree_util.tree_map(widen, (params, x, x_prime))
  grads, norms, tau = _float64_pair_grads(embed_fn, loss, eps)(p64, x64, xp64)
  clip_by = norms if clip_by is None else jnp.asarray(clip_by, jnp.float64)
  lam = tau * jnp.minimum(1.0, clip_norm / clip_by)
  return np.asarray(norms), jax.tree_util.tree_map(lambda g: jnp.tensordot(lam, g, axes=2), grads)


@functools.cache
def _float64_pair_grads(embed_fn, loss, eps: float):
  """jitted (p, x, x') ↦ (∇_w Z_ij stacked (n, n, ...), ‖∇_w Z_ij‖ (n, n), τ = ∂ℒ/∂Z (n, n)),
  each ∇_w Z_ij by its own jax.grad (one compilation per model, loss and shapes)."""
  def unit(p, xe):
    u = embed_fn(p, xe[None])[0]
    return u / jnp.sqrt(jnp.sum(u * u) + eps * eps)

  @jax.jit
  def pair_grads(p64, x64, xp64):
    n = x64.shape[0]

    def pair_grad(i, j):
      return jax.grad(lambda p: jnp.dot(unit(p, x64[i]), unit(p, xp64[j])))(p64)

    rows, cols = jnp.meshgrid(jnp.arange(n), jnp.arange(n), indexing="ij")
    grads = jax.vmap(jax.vmap(pair_grad))(rows, cols)
    norms = jnp.sqrt(
        sum(jnp.sum(g.reshape(n, n, -1) ** 2, -1) for g in jax.tree_util.tree_leaves(grads)))
    z = jax.vmap(lambda a: unit(p64, a))(x64) @ jax.vmap(lambda a: unit(p64, a))(xp64).T
    tau = jax.grad(loss)(z, jnp.ones((n,), bool))
    return grads, norms, tau

  return pair_grads


#: Set (to any non-empty value) where jax_privacy must be installed: its tests then fail
#: instead of skipping (.ci/run sets it).
REQUIRE_JAX_PRIVACY = "LOGIT_DP_REQUIRE_JAX_PRIVACY"


def import_jax_privacy():
  """jax_privacy, or a skip with the reason (a failure where REQUIRE_JAX_PRIVACY is set); at
  module level it skips or fails the whole module."""
  import pytest
  try:
    import jax_privacy
  except ImportError as e:
    message = f"jax_privacy is not installed ({e}): pip install -e '.[jax-privacy]'"
    if os.environ.get(REQUIRE_JAX_PRIVACY):
      pytest.fail(f"{message}; {REQUIRE_JAX_PRIVACY} is set.", pytrace=False)
    pytest.skip(message, allow_module_level=True)
  return jax_privacy


# The python blocks of the README and of the documentation pages. A block is standalone (it runs
# in a fresh namespace), unless its first line says it continues the one before it,
# "# Continues the block above (the names it uses)."; it then runs in that block's namespace.
CONTINUED = re.compile(r"# Continues the blocks? above\b")


def python_blocks(text: str) -> list[str]:
  """The ```python fenced blocks of a markdown text."""
  return re.findall(r"```python\n(.*?)```", text, re.S)


def continues(block: str) -> bool:
  """Whether a block is marked as continuing the block before it."""
  return CONTINUED.match(block) is not None


def free_names(block: str) -> set[str]:
  """The names a block reads without defining or importing them (builtins aside): what it
  needs from the blocks before it."""
  import ast
  import builtins
  defined, read = set(), set()
  for node in ast.walk(ast.parse(block)):
    if isinstance(node, ast.Name):
      (defined if isinstance(node.ctx, (ast.Store, ast.Del)) else read).add(node.id)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      defined.add(node.name)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      args = node.args
      defined.update(a.arg for a in args.posonlyargs + args.args + args.kwonlyargs)
      defined.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
    elif isinstance(node, ast.ExceptHandler) and node.name:
      defined.add(node.name)
  return read - defined - set(dir(builtins))


def run_blocks(blocks, where: str):
  """Runs the blocks in order, each standalone one in a fresh namespace and each continued one
  in the namespace of the block before it; yields (block, namespace, printed lines)."""
  import contextlib
  import io
  namespace = None
  for i, block in enumerate(blocks):
    if continues(block):
      assert namespace is not None, f"{where} block {i} continues no block"
    else:
      namespace = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(block, f"{where} python block {i}", "exec"), namespace)  # noqa: S102
    yield block, namespace, out.getvalue().splitlines()


def scripted_trainer(calls: list, method_results, fail_at: int | None = None):
  """A stand-in for experiments.clip.train_and_evaluate that trains nothing: it appends each
  workdir to ``calls``, raises KeyboardInterrupt once at call number ``fail_at`` (an interrupted
  run), and writes the workdir's config.json and a results.json whose one method's entry is
  ``method_results(cfg, method)`` (the scripted outcome)."""
  import json  # pylint: disable=g-import-not-at-top

  from experiments import workdirs  # pylint: disable=g-import-not-at-top

  def train_fn(cfg, workdir, quiet=True):
    del quiet
    calls.append(workdir)
    if fail_at is not None and len(calls) == fail_at:
      raise KeyboardInterrupt("interrupted")
    os.makedirs(workdir, exist_ok=True)
    workdirs.write_config(cfg, os.path.join(workdir, "config.json"))
    (method,) = cfg.methods
    results = dict(num_records=64, num_test=50, num_classes=10,
                   methods={method: method_results(cfg, method)})
    with open(os.path.join(workdir, "results.json"), "w") as f:
      json.dump(results, f)
    return results

  return train_fn
