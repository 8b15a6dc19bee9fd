"""Smoke test of the step benchmark harness (benchmarks/step_benchmark.py).

Runs the harness end to end at n = 8 and checks what it writes: the JSON schema, that
every ratio is positive and finite, and the markdown table. No timing assertions. The harness
runs are slow-marked (`-m slow`); the default run keeps the pure helpers.
"""

import json
import math

import jax.numpy as jnp
import pytest

from benchmarks import step_benchmark
from helpers import make_batch


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "bench.json"
  md = out.with_suffix(".md")
  report = step_benchmark.main([
      "--quick", "--methods", "nonprivate,ghost", "--memory", "sampler", "--compile-cache", "",
      "--out",
      str(out), "--markdown",
      str(md)
  ])
  return report, out, md


@pytest.mark.slow  # the harness end to end (quick_run)
def test_json_schema(quick_run):
  report, out, _ = quick_run
  on_disk = json.loads(out.read_text())
  assert on_disk["schema"] == step_benchmark.SCHEMA
  for key in ("created_utc", "finished_utc", "command", "machine", "code", "settings", "results",
              "scaling"):
    assert key in on_disk, key
  assert on_disk["machine"]["jax"]
  by_method = {r["method"]: r for r in on_disk["results"]}
  assert set(by_method) == {"nonprivate", "ghost"}
  for r in on_disk["results"]:
    assert r["model"] == "embedding" and r["n"] == 8
  for method in ("nonprivate", "ghost"):
    r = by_method[method]
    assert r["status"] == "ok", r.get("reason")
    assert len(r["times_s"]) == r["repeats"] >= 1
    for key in ("median_s", "min_s", "ratio_median", "ratio_min", "compile_s", "warmup_s"):
      assert math.isfinite(r[key]) and r[key] > 0, (method, key, r[key])
  assert by_method["nonprivate"]["ratio_median"] == 1.0
  assert report["results"] == on_disk["results"]


@pytest.mark.slow  # the harness end to end (quick_run)
def test_markdown(quick_run):
  report, _, md = quick_run
  text = md.read_text()
  assert "Logit-DP ghost / non-private" in text
  assert "| embedding | 8 | Logit-DP ghost |" in text
  assert text.strip() == step_benchmark.markdown(report).strip()


@pytest.mark.slow  # the harness end to end (quick_run)
def test_render_merges(quick_run, capsys):
  _, out, _ = quick_run
  merged = step_benchmark.main(["--render", str(out), str(out)])
  assert len(merged["results"]) == 2
  assert "Logit-DP ghost" in capsys.readouterr().out


@pytest.mark.slow  # the harness end to end (quick_run)
def test_render_keeps_memory_only_sizes_and_labels_device_memory(quick_run, tmp_path, capsys):
  """A memory-only file with a size the timing run lacks, on an accelerator's report."""
  _, out, _ = quick_run
  timing = json.loads(out.read_text())
  timing["machine"]["platform"] = "gpu"
  for r in timing["results"]:  # what bench_config records on an accelerator
    r.pop("inproc_rss_peak_bytes", None)
    r["xla_device_bytes"] = r["xla_bytes"]
  memory = {
      "results": [{
          "model": "embedding", "n": 16, "method": "ghost", "spec": "ghost",
          "microbatch_size": None, "memory_only": True, "peak_device_bytes": 123_000_000
      }]
  }
  a, b = tmp_path / "timing.json", tmp_path / "memory.json"
  a.write_text(json.dumps(timing))
  b.write_text(json.dumps(memory))
  merged = step_benchmark.main(["--render", str(a), str(b)])
  text = capsys.readouterr().out
  extra = step_benchmark._get(merged["results"], "embedding", 16, "ghost")
  assert extra["status"] == "not timed"
  assert extra["num_params"] == timing["results"][0]["num_params"]
  assert "| embedding | 16 | Logit-DP ghost | — |" in text and "0.12 GB" in text
  ghost8 = step_benchmark._get(merged["results"], "embedding", 8, "ghost")
  assert step_benchmark.peak_memory(ghost8) == ghost8["xla_bytes"]
  assert "XLA's buffer assignment" in text and "peak RSS" not in text


def test_scaling_exponent_fit():
  results = [{"model": "embedding", "n": n, "spec": "ghost", "median_s": 1e-3 * n ** 2}
             for n in (64, 256, 1000)]
  sc = step_benchmark.scaling_exponents(results)
  assert sc["embedding"]["ghost"]["exponent"] == pytest.approx(2.0)


def test_unknown_method_rejected():
  with pytest.raises(ValueError, match="unknown method"):
    step_benchmark.parse_method("nope")
  assert step_benchmark.parse_method("triangle@8") == ("triangle", 8)


def test_pre_gate_skips_what_cannot_run():
  args = step_benchmark.parse_args(["--max-step-s", "100", "--memory-limit-gb", "12"])

  def gate(method, n, p=6296, d=8, t_np=0.5, held=None):
    e = {"method": method}
    return step_benchmark.pre_gate(e, n, p, d, t_np, args, held)

  assert gate("materialize", 1000) and "max-step-s" in gate("materialize", 1000)  # 500 s
  assert gate("materialize", 64) is None  # 32 s
  assert gate("triangle", 64, t_np=20.0)  # ≥ 160 s
  assert gate("ghost", 4096) is None  # 1.6 GB
  assert "does not fit" in gate("ghost", 64, p=11_200_000, t_np=1.0)  # 46 GB
  assert gate("ghost", 64, p=11_200_000, t_np=1.0, held=5_000_000) is None  # 2.6 GB
  assert gate("nonprivate", 10 ** 6, t_np=1e3) is None


@pytest.mark.slow  # the loop_conv harness
def test_loop_conv_benchmark_runs_and_both_gradients_agree(tmp_path):
  from benchmarks import loop_conv  # pylint: disable=g-import-not-at-top
  out = tmp_path / "loop_conv.json"
  report = loop_conv.main(
      ["--shape", "4,6,6,3", "--features", "5", "--repeats", "1", "--out",
       str(out)])
  assert json.loads(out.read_text())["results"] == report["results"]
  assert [r["stride"] for r in report["results"]] == [1, 2]
  for r in report["results"]:
    assert set(r["median_s"]) == {
        f"{conv} / {how}" for conv in ("jax", "channels_last") for how in ("unrolled", "lax.map")
    }
    assert all(math.isfinite(t) and t > 0 for t in r["median_s"].values())
    assert r["max_rel_diff"] < 1e-5


@pytest.mark.slow  # the precision_check harness
def test_precision_check_runs_and_the_cpu_default_is_float32():
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks import precision_check  # pylint: disable=g-import-not-at-top
  with jax.default_matmul_precision(None):  # the backend's default, not the tests' "highest"
    row = precision_check.check("embedding", n=4, image_size=16)
  assert row["pairs"] > 0 and row["num_params"] > 0
  if row["backend"] == "cpu":  # XLA:CPU computes float32 contractions in float32
    assert row["norm_error_max"] < 1e-6 and row["vector_error_max"] < 1e-6, row
  else:
    assert math.isfinite(row["norm_error_max"]) and math.isfinite(row["vector_error_max"]), row


@pytest.mark.slow  # the profile_ghost harness
def test_profile_ghost_runs_every_piece_and_adds_up_the_floor():
  """profile_ghost still reaches the private internals it times (it reports those it cannot
  as unavailable, which would hide a broken profile)."""
  from benchmarks import profile_ghost  # pylint: disable=g-import-not-at-top

  result = profile_ghost.profile(4, repeats=1, image_size=8)
  assert result["unavailable"] == {}
  pieces = result["pieces"]
  for name in ("forward", "factors", "flat cross", "positives from factors", "positives in float64",
               "pair norms", "backward ḡ", "ghost grad", "non-private step", "GEMM floor",
               "backward passes"):
    assert pieces[name]["median_s"] > 0, name
  at_gemm_speed = 2 * result["pair_multiply_adds"] / (result["gemm_gflops_per_s"] * 1e9)
  assert pieces["pair terms at GEMM speed"]["median_s"] == pytest.approx(at_gemm_speed)
  assert pieces["floor"]["median_s"] == pytest.approx(pieces["backward passes"]["median_s"]
                                                      + at_gemm_speed)
  assert "| floor |" in profile_ghost.markdown([result])


@pytest.mark.slow  # profile_ghost's count against XLA's
def test_profile_floor_counts_the_multiply_adds_xla_counts():
  """profile_ghost's pair-term count = XLA's own flop count of the cross terms / 2.

  XLA may count a ghost layer's final O(d) contraction with v̂_j as elementwise work, so
  the two may differ by at most n²·d per ghost layer; the T²P, TCd, T²C and d²q terms
  must agree.
  """
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks import profile_ghost  # pylint: disable=g-import-not-at-top
  from logit_dp._src.methods import ghost  # pylint: disable=g-import-not-at-top

  n = 6  # 8×8 images: conv1 flattened; conv2, conv3 and the dense head ghost layers
  embed_fn, params, x, xp, _ = step_benchmark.build_problem("embedding", n, 8)
  batch = make_batch(embed_fn, params, x, xp)
  f_u, f_v = batch.factors(batch.x), batch.factors(batch.x_prime)
  assert any(batch.plan.ghost) and not all(batch.plan.ghost)

  def cross_terms(fu, fv, u, v):
    total = ghost.flat_cross_terms(fu.flat, u, fv.flat, v)
    for a_u, dl_u, a_v, dl_v in zip(fu.ghost_patches, fu.ghost_deltas, fv.ghost_patches,
                                    fv.ghost_deltas):
      total += ghost.ghost_layer_cross_terms(a_u, dl_u, u, a_v, dl_v, v)
    return total

  analysis = jax.jit(cross_terms).lower(f_u, f_v, batch.u_loc, batch.v).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  d = batch.u.shape[-1]
  counted = n * n * profile_ghost.pair_multiply_adds(batch.plan, d)
  assert abs(analysis["flops"] / 2 - counted) <= n * n * d * sum(batch.plan.ghost)


@pytest.mark.slow  # six compilations of the clipped gradient
def test_diagonal_cost_times_every_variant_and_restores_the_library():
  from benchmarks import diagonal_cost  # pylint: disable=g-import-not-at-top
  before = [getattr(module, name) for module, name in diagonal_cost._SWITCHES]
  rows = diagonal_cost.main(
      ["--sizes", "4", "--repeats", "1", "--microbatch", "2", "--image-size", "8"])
  assert [r["method"] for r in rows] == ["ghost", "triangle"]
  assert all(r[f"{v}_s"] > 0 for r in rows for v in diagonal_cost.VARIANTS)
  assert all(math.isfinite(r["ratio"]) and math.isfinite(r["float64_ratio"]) for r in rows)
  assert [getattr(module, name) for module, name in diagonal_cost._SWITCHES] == before


@pytest.mark.slow  # four compilations; the forms themselves are tested in test_projected.py
def test_projected_forms_benchmark_times_both_forms_and_they_agree():
  from benchmarks import projected_forms  # pylint: disable=g-import-not-at-top
  from logit_dp._src import projection  # pylint: disable=g-import-not-at-top
  saved = projection.GRAM_FORM_MAX_DIM
  rows = projected_forms.main(
      ["--sizes", "12", "--dims", "4", "--rank", "6", "--repeats", "1", "--image-size", "8"])
  assert projection.GRAM_FORM_MAX_DIM == saved  # the library is restored
  (row,) = rows
  assert set(row["median_s"]) == {"non_private", "triangle", "projected_gram", "projected_vector"}
  # Not bit-equal: the Gram form's squared norms carry ε_G·S² more allowance (≤ √ε_G·S = 2⁻¹⁰·S
  # on a norm), which moves the clip factors of clipped pairs by as much.
  assert row["grad_relative_difference"] < 1e-3


@pytest.mark.slow  # four compilations; factors_times itself is tested in test_layerwise.py
def test_projected_jacobians_benchmark_times_both_ways_and_restores_the_library():
  from benchmarks import projected_jacobians  # pylint: disable=g-import-not-at-top
  from logit_dp._src.methods import bounds  # pylint: disable=g-import-not-at-top
  before = bounds.projected_jacobians
  (row,) = projected_jacobians.main([
      "--sizes", "12", "--dims", "4", "--rank", "6", "--microbatch", "4", "--repeats", "1",
      "--image-size", "8"
  ])
  assert bounds.projected_jacobians is before
  assert set(
      row["median_s"]) == {"non_private", "triangle", "projected_gemm", "projected_transpose"}
  # The same J_eQ̃ up to float32 rounding, so the same clip factors up to their allowances.
  assert row["grad_relative_difference"] < 1e-4


def test_allocator_summary_pairs_each_step_across_processes():
  """Each allocator's mean of its processes' medians, and the ratio preloaded / default."""
  from benchmarks import allocator
  processes = [
      dict(allocator="default", steps={"m n=8 ghost": 2.0, "m n=8 nonprivate": 1.0}),
      dict(allocator="preloaded", steps={"m n=8 ghost": 1.5}),
      dict(allocator="preloaded", steps={"m n=8 ghost": 1.7, "m n=8 nonprivate": 0.9}),
      dict(allocator="default", steps={"m n=8 ghost": 2.2, "m n=8 nonprivate": 1.1}),
  ]
  table = allocator.summarize(processes)
  assert table["m n=8 ghost"]["default"]["times_s"] == [2.0, 2.2]
  assert table["m n=8 ghost"]["ratio"] == pytest.approx(1.6 / 2.1)
  assert table["m n=8 nonprivate"]["preloaded"]["times_s"] == [0.9]
  assert table["m n=8 nonprivate"]["ratio"] == pytest.approx(0.9 / 1.05)
  # A step that only one allocator's processes timed (skipped in the other) has no ratio.
  processes.append(
      dict(allocator="default", steps={"m n=8 triangle": 3.0}, user_s=1.0, system_s=0.1,
           minor_faults=10))
  table = allocator.summarize(processes)
  assert table["m n=8 triangle"]["ratio"] is None
  md = allocator.markdown(
      dict(preload="/lib/libtcmalloc.so", rounds=2, steps=table, processes=processes[-1:]))
  assert "| m n=8 triangle | 3.000 | – | – |" in md


def test_allocator_preload_check_tells_a_mapped_library_from_a_missing_one(tmp_path):
  from benchmarks import allocator
  assert not allocator.preload_is_mapped(str(tmp_path / "libmissing.so"))
  found = allocator.find_preload()
  if found is None:
    pytest.skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4)")
  assert allocator.preload_is_mapped(found)


@pytest.mark.slow  # two step_benchmark processes
def test_allocator_benchmark_end_to_end(tmp_path):
  from benchmarks import allocator
  if allocator.find_preload() is None:
    pytest.skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4)")
  out = tmp_path / "allocator.json"
  report = allocator.main([
      "--rounds", "1", "--out",
      str(out), "--", "--quick", "--methods", "nonprivate", "--compile-cache", ""
  ])
  assert json.loads(out.read_text())["schema"] == allocator.SCHEMA
  assert [p["allocator"] for p in report["processes"]] == ["default", "preloaded"]
  (row,) = report["steps"].values()
  assert row["ratio"] == pytest.approx(row["preloaded"]["mean_s"] / row["default"]["mean_s"])
  assert all(p["minor_faults"] > 0 and p["user_s"] > 0 for p in report["processes"])


@pytest.mark.slow  # two trainings compiled in a fresh process
def test_first_built_benchmark_counts_no_accountant_run_and_no_compile_in_timed_steps(tmp_path):
  """Both trainings of one process (first built and second built) step without running the
  privacy accountant or compiling, and every phase is timed and summarised."""
  from benchmarks import first_built
  out = tmp_path / "first_built.json"
  report = first_built.main([
      "--configs", "mlp:8:naive", "--timed-steps", "2", "--warmup-steps", "1", "--rounds", "2",
      "--out",
      str(out)
  ])
  assert report is not None and json.loads(out.read_text())["schema"] == first_built.SCHEMA
  (result,) = report["results"]
  for mode in first_built.MODES:
    for label in ("A", "B"):
      phase = result["phases"][f"{label} {mode}"]
      assert phase["accountant_runs"] == 0 and phase["compiles"] == 0
      assert len(phase["step_s"]) == 2  # timed steps; alternating: one per round
    assert all(math.isfinite(v) and v > 0 for v in result["ratio"][mode].values())
  assert first_built.markdown(report).count("\n") == 2  # header, rule, one row


def test_first_built_markdown_sums_the_counts_of_every_phase():
  from benchmarks import first_built
  phases = {
      f"{label} {mode}": dict(accountant_runs=runs, compiles=0) for mode in first_built.MODES
      for label, runs in (("A", 3), ("B", 1))
  }
  ms = {f"{label} alone": dict(draw=2.0, cpu=10.0) for label in ("A", "B")}
  ratio = {mode: dict(cpu=1.5, wall=2.0) for mode in first_built.MODES}
  md = first_built.markdown(
      dict(results=[
          dict(model="mlp", n=8, method="ghost", phases=phases, median_ms=ms, ratio=ratio)
      ]))
  assert md.splitlines()[-1] == ("| mlp | 8 | ghost | 1.50 (2.00) | 1.50 (2.00) | 1.50 (2.00) | "
                                 "2.0, 2.0 | 10.0, 10.0 | 9, 3 | 0, 0 |")


@pytest.mark.slow  # three compilations of a training step
def test_ghost_chunk_rows_times_each_cap_and_restores_the_library():
  from benchmarks import ghost_chunk_rows  # pylint: disable=g-import-not-at-top
  from logit_dp._src import chunking  # pylint: disable=g-import-not-at-top
  shipped = chunking.ghost_layer_chunk_rows
  (result,) = ghost_chunk_rows.main(["--sizes", "8", "--rows", "1", "--repeats", "1"])
  assert set(result["variants"]) == {"non-private", "ghost", "ghost, 1 row"}
  assert all(v["ratio"] > 0 for v in result["variants"].values())
  assert result["shipped_rows"] == 8 and chunking.ghost_layer_chunk_rows is shipped


@pytest.mark.slow  # the grouped_cost harness
def test_grouped_cost_benchmark_reports_memory_and_step_ratios(tmp_path, capsys):
  from benchmarks import grouped_cost  # pylint: disable=g-import-not-at-top
  out = tmp_path / "grouped_memory.json"
  grouped_cost.main(["memory", "--tiny", "--out", str(out)])
  memory = json.loads(out.read_text())
  assert memory["accumulator_bytes"] == 4 * memory["num_groups"] * memory["parameters"]
  assert memory["temp_bytes"] > 0
  assert memory["temp_over_accumulator"] == memory["temp_bytes"] / memory["accumulator_bytes"]
  capsys.readouterr()
  grouped_cost.main(["time", "--tiny"])
  timed = json.loads(capsys.readouterr().out)
  assert timed["ratio"] == timed["dp_gcl_s"] / timed["nonprivate_s"] and timed["dp_gcl_s"] > 0


def test_transformers_benchmark_times_a_step_until_its_repeats_add_up_to_min_seconds():
  import time  # pylint: disable=g-import-not-at-top

  from benchmarks import transformers  # pylint: disable=g-import-not-at-top
  calls = []

  def step():
    calls.append(None)
    time.sleep(0.002)
    return jnp.zeros(())

  assert len(transformers._timed(step, (), 3, 0.0)) == 3 and len(calls) == 4  # one untimed
  times = transformers._timed(step, (), 2, 0.03)
  assert sum(times) >= 0.03 and 2 <= len(times) <= 200
  assert len(transformers._timed(step, (), 1, 60.0)) == 100  # at most 100·repeats


@pytest.mark.slow  # the transformers harness: three compilations per model
def test_transformers_benchmark_measures_every_method_and_renders_its_table(tmp_path):
  from benchmarks import transformers  # pylint: disable=g-import-not-at-top
  tiny = dict(width=8, depth=1, num_heads=2, mlp_dim=16, length=4, vocab_size=20, image_side=8,
              patch_size=4, embedding_dim=4)
  row = transformers.measure("linen", "clip", 8, ("ghost", "dp_gcl"), 1, min_seconds=0.0, **tiny)
  assert set(row["ratio"]) == {"nonprivate", "ghost", "dp_gcl"}
  assert row["steps_timed"] == {"nonprivate": 1, "ghost": 1, "dp_gcl": 1}
  assert row["ratio"]["ghost"] == row["step_s"]["ghost"] / row["step_s"]["nonprivate"]
  assert row["floor"]["ghost_floor_ratio"] > 1
  assert row["xla_compile_ratio"]["ghost"] == (row["xla_compile_s"]["ghost"]
                                               / row["xla_compile_s"]["nonprivate"])
  # XLA's compile is part of the first call, and the private gradient's is the larger.
  assert 0 < row["xla_compile_s"]["nonprivate"] < row["xla_compile_s"]["ghost"]
  assert row["xla_compile_s"]["ghost"] < row["compile_s"]["ghost"] + row["step_s"]["ghost"]
  assert all(route != "jacrev" for _, route in row["routes"])
  table = transformers.table([row]).splitlines()
  assert len(table) == 3 and table[2].startswith("| linen | clip | 8 |")
  assert "ghost XLA compile" in table[0] and table[2].count("|") == table[0].count("|")
  older = {k: v for k, v in row.items() if not k.startswith("xla_")}  # a row without it
  assert "XLA" not in transformers.table([older]).splitlines()[0]
  assert ("CPU steal" in table[0]) == (row["cpu_steal"] is not None)


def test_transformers_table_shows_no_compile_time_where_a_step_outlasted_the_first_call():
  from benchmarks import transformers  # pylint: disable=g-import-not-at-top
  row = {
      "framework": "linen", "arch": "vit", "n": 512, "step_s": {"nonprivate": 1.43, "ghost": 229.0},
      "ratio": {"nonprivate": 1.0, "ghost": 160.5},
      "compile_ratio": {"nonprivate": 1.0, "ghost": -4.9}, "floor": {"ghost_floor_ratio": 94.8}
  }
  cells = transformers.table([row]).splitlines()[2].split(" | ")
  assert cells[4:7] == ["160.5×", "—", "94.8× |"]
  row["compile_ratio"]["ghost"] = 0.0
  assert transformers.table([row]).splitlines()[2].split(" | ")[5] == "0.0×"


def test_cpu_steal_is_the_hypervisors_share_of_the_cpu_time_between_two_readings():
  from benchmarks import transformers  # pylint: disable=g-import-not-at-top
  assert transformers._steal_fraction((0, 100), (10, 200)) == 0.1
  assert transformers._steal_fraction(None, (10, 200)) is None
  assert transformers._steal_fraction((10, 200), (10, 200)) is None  # no time between them
  reading = transformers.cpu_steal()
  if reading is not None:  # Linux
    assert 0 <= reading[0] <= reading[1]


def test_pipeline_path_walks_the_chains_depth_first_and_counts_each_return():
  from benchmarks import pipeline_path
  step, batch, plan, method = (("m.step", "step"), ("m.batch", "init"), ("m.layers", "plan"),
                               ("m.method", "norms"))
  chains = [(step, batch, plan), (step, batch, plan), (step, method, batch)]
  # Depth first: step, batch, layers, back to batch, back to step, method, batch, back up.
  assert pipeline_path.walk(pipeline_path.tree(chains)) == [
      "m.step", "m.batch", "m.layers", "m.batch", "m.step", "m.method", "m.batch", "m.method",
      "m.step"
  ]
  summary = pipeline_path.summary(chains)
  assert (summary["stops"], summary["modules"], summary["returns"]) == (9, 4, 5)
  assert summary["functions"] == 4 and summary["per_module"]["m.batch"] == 3


def test_pipeline_path_records_the_package_functions_between_a_call_and_the_model():
  import logit_dp
  from benchmarks import pipeline_path

  def model(params, x):
    return params * x

  chains = pipeline_path.model_chains(
      lambda: logit_dp.clipped_grad(model, logit_dp.losses.contrastive(1.0), 1.0, "triangle"),
      model.__code__)
  assert chains == []  # building the gradient calls no model
  chains = pipeline_path.model_chains(
      lambda: logit_dp._src.rows.map_rows(lambda x: model(2.0, x), jnp.ones((2, 3)), None),
      model.__code__)
  assert chains and all(chain[-1][0] == "logit_dp._src.rows" for chain in chains)


def test_flat_cross_benchmark_times_both_forms_of_the_same_cross_terms(capsys):
  from benchmarks import flat_cross  # pylint: disable=g-import-not-at-top
  flat_cross.main(["--n", "6", "--d", "12", "--q", "40", "--repeats", "1"])
  result = json.loads(capsys.readouterr().out)
  assert set(result["seconds"]) == {"vectors", "cross-Gram"}
  assert result["ratio"] == result["seconds"]["cross-Gram"] / result["seconds"]["vectors"]
  assert result["max_relative_difference"] < 1e-5
