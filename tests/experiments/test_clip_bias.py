"""experiments/clip_bias.py: the positive/negative split of the clipped gradient ḡ."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import logit_dp
from experiments import clip_bias


def _embed(params, x):
  return jnp.tanh(x @ params["w1"]) @ params["w2"]


@pytest.mark.slow
@pytest.mark.parametrize("clip_norm", [jnp.inf, 1e-5])
def test_positive_and_negative_parts_add_up_and_match_jax_grad(clip_norm):
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = dict(w1=jax.random.normal(k[0], (5, 7)), w2=jax.random.normal(k[1], (7, 3)))
  x, x_prime = jax.random.normal(k[2], (12, 5)), jax.random.normal(k[3], (12, 5))
  loss = logit_dp.losses.contrastive(temperature=1.0)
  method = "ghost"
  total, parts = clip_bias.gradient_parts(_embed, loss, clip_norm, method, params, x, x_prime)
  for leaf, pos, neg in zip(
      *(jax.tree_util.tree_leaves(t) for t in (total, parts["positive"], parts["negative"]))):
    np.testing.assert_allclose(pos + neg, leaf, rtol=1e-4, atol=1e-6 * float(jnp.abs(leaf).max()))
  if not np.isfinite(clip_norm):
    # Unclipped, the positive part is jax.grad through the diagonal Z_ii only.
    def diagonal_loss(p):
      z = logit_dp.losses.cosine_similarity(_embed(p, x), _embed(p, x_prime))
      eye = jnp.eye(12, dtype=bool)
      return loss(jnp.where(eye, z, jax.lax.stop_gradient(z)))

    want = jax.grad(diagonal_loss)(params)
    for got, w in zip(jax.tree_util.tree_leaves(parts["positive"]),
                      jax.tree_util.tree_leaves(want)):
      np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6)
  else:
    # Every pair clipped to B: each part is at most (Σ of its |τ_ij|)·B in norm.
    z = logit_dp.losses.cosine_similarity(_embed(params, x), _embed(params, x_prime))
    tau = jax.grad(loss)(z)
    pos_bound = float(jnp.sum(jnp.abs(jnp.diag(tau)))) * clip_norm
    assert float(optax.global_norm(parts["positive"])) <= pos_bound * (1 + 1e-5)


def test_clip_bias_table_renders_the_report():
  from experiments import render_results
  runs = {
      b:
          dict(
              at_init=dict(norm=2.0, cos_with_true_grad=c, positive_norm=3.0, negative_norm=1.5,
                           cos_positive_negative=-0.9),
              test_loss=[1000 * (6.9 + 0.001 * k) for k in range(21)],
              mean_negative_cosine=[0.5 + 0.01 * k for k in range(21)])
      for b, c in (("inf", 1.0), ("1e-5", -0.7))
  }
  report = dict(steps=20, lr=1e-2, clip_method="ghost", batch=100, subset=400,
                ln_n_test=float(np.log(1000)), runs=runs)
  text = render_results.clip_bias_table(report)
  rows = [line for line in text.splitlines() if line.startswith("| 1e-5")]
  cells = [c.strip() for c in rows[0].strip("|").split("|")]
  assert cells[2] == "-0.70" and cells[3] == "3" and cells[4] == "1.5"
  assert cells[6] == "6.9000 / 6.9100 / 6.9200"  # steps 0 / 10 / 20, loss per pair (n = 1,000)
  assert cells[7] == "0.500 / 0.600 / 0.700"
  assert "| ∞ (∇ℒ) |" in text


def _problem(seed: int, n: int):
  """The params of `_embed` (5 → 7 → 3) and n random pairs of 5-dim inputs."""
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  params = dict(w1=jax.random.normal(k[0], (5, 7)), w2=jax.random.normal(k[1], (7, 3)))
  return params, jax.random.normal(k[2], (n, 5)), jax.random.normal(k[3], (n, 5))


@pytest.mark.slow
def test_signal_to_noise_measures_against_the_library_and_jax_grad():
  from experiments import signal_to_noise  # pylint: disable=g-import-not-at-top
  params, x, x_prime = _problem(seed=1, n=16)
  loss = logit_dp.losses.contrastive(temperature=1.0)
  p = 5 * 7 + 7 * 3
  # Nothing clipped: every Logit-DP ḡ and DP-GCL's sum are the unclipped gradients.
  big = signal_to_noise.measure(_embed, params, x, x_prime, loss, 1e6, 2.0, ["ghost", "triangle"],
                                group_size=4.0)
  for name in ("logit_dp_ghost", "logit_dp_triangle"):
    assert big[name]["cos_with_true_grad"] == pytest.approx(1.0, abs=1e-5)
  assert big["dp_gcl"]["cos_with_unclipped_group_sum"] == pytest.approx(1.0, abs=1e-5)
  assert big["dp_gcl"]["num_groups"] == 4
  # Every pair / group clipped: the library's sensitivities, and ‖ḡ‖ ≤ (number of terms)·B.
  small = signal_to_noise.measure(_embed, params, x, x_prime, loss, 1e-3, 2.0, ["ghost"],
                                  group_size=4.0)
  assert small["logit_dp_ghost"]["sensitivity"] == logit_dp.sensitivity(loss, 1e-3)
  assert small["naive_dp"]["sensitivity"] == logit_dp.baselines.naive_sensitivity(1e-3)
  assert small["dp_gcl"]["sensitivity"] == logit_dp.baselines.grouped_sensitivity(1e-3) == 2e-3
  assert small["dp_gcl"]["grad_norm"] <= 4 * 1e-3 * (1 + 1e-6)
  for m in small.values():
    assert m["snr"] == pytest.approx(m["grad_norm"] / (2.0 * m["sensitivity"] * p ** 0.5))
    assert abs(m["cos_with_true_grad"]) <= 1.0 + 1e-6


@pytest.mark.slow
def test_signal_to_noise_measures_contrast_clipping():
  from experiments import signal_to_noise  # pylint: disable=g-import-not-at-top
  params, x, x_prime = _problem(seed=2, n=12)
  loss = logit_dp.losses.contrastive(temperature=2.0)
  # Nothing clipped: exact Logit-DP and contrast clipping are ∇ℒ; their SNRs differ by the
  # constants alone.
  big = signal_to_noise.measure(_embed, params, x, x_prime, loss, 1e6, 2.0, [], group_size=4.0,
                                contrast=True, contrast_group_sizes=(4,))
  for name in ("logit_dp_exact", "contrast", "contrast_bound"):
    assert big[name]["cos_with_true_grad"] == pytest.approx(1.0, abs=1e-5)
  assert big["contrast_bound"]["snr"] == pytest.approx(big["contrast"]["snr"], rel=1e-5)
  assert big["contrast"]["snr"] / big["logit_dp_exact"]["snr"] == pytest.approx(
      logit_dp.sensitivity(loss, 1.0) / logit_dp.contrast_clipping.contrast_sensitivity(loss, 1.0),
      rel=1e-5)
  grouped = big["grouped_contrast_s4"]
  assert grouped["num_groups"] == 3
  assert grouped["sensitivity"] == pytest.approx(2 * grouped["group_clip_norm"])
  # Each method's B at the median of its own norms.
  median = signal_to_noise.measure(_embed, params, x, x_prime, loss, 1e6, 2.0, [], group_size=4.0,
                                   contrast=True, clip_quantile=0.5, contrast_group_sizes=(4,))
  cc = logit_dp.contrast_clipping
  batch = cc.dense_batch(_embed, params, x, x_prime)
  norms = np.asarray(cc.clipped_sums(batch, loss, float("inf"))["norms"])
  expected = np.quantile(norms[~np.eye(12, dtype=bool)], 0.5)
  assert median["contrast"]["clip_norm"] == pytest.approx(expected, rel=1e-6)
  assert median["contrast"]["sensitivity"] == pytest.approx(cc.contrast_sensitivity(loss, expected))
  # The bound clips at the exact norms' B: more is clipped, so ḡ is shorter.
  bounded = median["contrast_bound"]
  assert bounded["clip_norm"] == median["contrast"]["clip_norm"]
  assert bounded["sensitivity"] == median["contrast"]["sensitivity"]
  assert bounded["grad_norm"] < median["contrast"]["grad_norm"]
  bound = np.asarray(cc.clipped_sums(batch, loss, float("inf"), norms="bound")["norms"])
  ratios = bound[~np.eye(12, dtype=bool)] / norms[~np.eye(12, dtype=bool)]
  assert bounded["bound_over_norm"]["q0.5"] == pytest.approx(np.median(ratios), rel=1e-6)
  assert bounded["bound_over_norm"]["q0.1"] > 1.0
  assert median["dp_gcl"]["clip_norm"] < 1e6 and median["naive_dp"]["clip_norm"] == pytest.approx(
      median["logit_dp_exact"]["clip_norm"])
  with pytest.raises(ValueError, match="--contrast"):
    signal_to_noise.measure(_embed, params, x, x_prime, loss, 1.0, 2.0, [], clip_quantile=0.5)


def test_contrast_snr_table_divides_by_exact_logit_dp():
  from experiments import render_results  # pylint: disable=g-import-not-at-top
  m = dict(grad_norm=1.0, sensitivity=2.0, noise_norm=4.0)
  report = dict(
      n=512, parameters="initial", clip_norm=3.0, temperature=2.0, clip_quantile=0.5,
      methods=dict(logit_dp_exact=dict(m, snr=0.1, cos_with_true_grad=0.5),
                   contrast=dict(m, snr=0.15, cos_with_true_grad=1.0),
                   contrast_bound=dict(m, snr=0.12, cos_with_true_grad=1.0),
                   grouped_contrast_s8=dict(m, snr=0.2, cos_with_true_grad=0.5)))
  older = dict(report, parameters="older", methods=dict(report["methods"]))
  del older["methods"]["contrast_bound"]
  text = render_results.contrast_snr_table([report, older])
  assert ("| Logit-DP, exact norms | contrast clipping | contrast clipping, bound norms | "
          "grouped contrast, s = 8 |") in text
  assert ("| initial | 512 | 0.5-quantile | 1.00 (+1.00) | 1.50 (+3.00) | 1.20 (+2.40) | "
          "2.00 (+2.00) |") in text
  assert "| older | 512 | 0.5-quantile | 1.00 (+1.00) | 1.50 (+3.00) | – | 2.00 (+2.00) |" in text


def test_signal_to_noise_table_renders_the_report():
  from experiments import render_results  # pylint: disable=g-import-not-at-top
  method = dict(grad_norm=50.0, sensitivity=2.0, noise_norm=400.0, snr=0.125,
                cos_with_true_grad=0.99)
  report = dict(
      n=2000, parameters="initial", clip_norm=1.0, temperature=1.0, noise_multiplier=2.7,
      methods=dict(logit_dp_projected=dict(method, sensitivity=16.8),
                   dp_gcl=dict(method, num_groups=250, cos_with_unclipped_group_sum=0.999)))
  text = render_results.signal_to_noise_table(report)
  assert "| Logit-DP, projected | 50 | 16.8 | 400 | 0.125 | +0.990 |" in text
  assert "Config changes" not in text
  report["overrides"] = {"temperature": 2.0, "model.embedding_dim": 16}
  assert "Config changes: temperature = 2.0, model.embedding_dim = 16." in (
      render_results.signal_to_noise_table(report))
  assert "| DP-GCL (250 groups; cos with its unclipped group sum +0.999) | 50 | 2 |" in text


def test_signal_to_noise_summary_lists_every_report():
  from experiments import render_results  # pylint: disable=g-import-not-at-top

  def report(parameters, projected_snr, gcl_snr):
    m = dict(grad_norm=1.0, sensitivity=2.0, noise_norm=4.0, cos_with_true_grad=0.5)
    return dict(
        n=10000, parameters=parameters, clip_norm=1.0, temperature=1.0,
        methods=dict(logit_dp_projected=dict(m, snr=projected_snr),
                     dp_gcl=dict(m, snr=gcl_snr, cos_with_true_grad=-0.25)))

  text = render_results.signal_to_noise_summary_table(
      [report("initial (seed 0)", 0.12, 0.6),
       report("trained", 0.05, 0.4)])
  assert "| initial (seed 0) | 10,000 | 0.12 (+0.50) | 0.6 (-0.25) | 5.0 |" in text
  assert "| trained | 10,000 | 0.05 (+0.50) | 0.4 (-0.25) | 8.0 |" in text
  assert "Config changes" not in text
  other = report("x", 0.1, 0.1)
  other["temperature"] = 2.0
  with pytest.raises(ValueError, match="different"):
    render_results.signal_to_noise_summary_table([report("a", 0.1, 0.1), other])
  wider = dict(report("x", 0.1, 0.1), overrides={"model.embedding_dim": 16})
  with pytest.raises(ValueError, match="different"):
    render_results.signal_to_noise_summary_table([report("a", 0.1, 0.1), wider])
  text = render_results.signal_to_noise_summary_table([wider, dict(wider, parameters="y")])
  assert "Config changes: model.embedding_dim = 16." in text


def test_signal_to_noise_parses_config_changes():
  from experiments import signal_to_noise  # pylint: disable=g-import-not-at-top
  assert signal_to_noise.parse_overrides([
      "temperature=2.0", "model.embedding_dim=16", "clip_method=projected"
  ]) == {"temperature": 2.0, "model.embedding_dim": 16, "clip_method": "projected"}
  with pytest.raises(ValueError, match="key=value"):
    signal_to_noise.parse_overrides(["temperature"])
