r"""The same training steps under glibc's malloc and under a preloaded allocator, side by side.

    python -m benchmarks.allocator --out results/allocator.json -- \
        --models embedding --sizes 4096 --methods nonprivate,ghost --repeats 3

Everything after ``--`` goes to `benchmarks.step_benchmark` unchanged (``--memory none`` is
added). Each round runs that benchmark twice, as two fresh processes: once with the default
allocator and once with ``LD_PRELOAD=--preload`` (tcmalloc by default), in alternating order
(round r starts with the other allocator than round r − 1), so drift in the machine's load
hits both alike. Per step configuration it reports each allocator's step times (the medians of
its processes) and the ratio preloaded / default; per process, the whole process's user and
system CPU seconds and minor page faults (`getrusage(RUSAGE_CHILDREN)` deltas: imports and
compilation included).

Why: XLA's CPU buffers above glibc's mmap threshold are mmap'ed and unmapped at every step, so
the kernel zeroes fresh pages each time (the exact-ghost CIFAR-10 run at n = 10,000 spent ~13% of
its CPU time in the kernel at ~165,000 page faults a second); tcmalloc keeps freed memory for
reuse. The preloaded library is checked to be mapped in a process started the same way.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

DEFAULT_PRELOAD_NAMES = ("tcmalloc_minimal", "tcmalloc")
SCHEMA = "logit_dp.allocator_benchmark/1"


def find_preload() -> str | None:
  """The path of tcmalloc's shared library (Debian: libtcmalloc-minimal4), or None."""
  for name in DEFAULT_PRELOAD_NAMES:
    found = ctypes.util.find_library(name)
    if found:
      for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib", "/lib"):
        if os.path.exists(os.path.join(d, found)):
          return os.path.join(d, found)
      return found
  return None


def _env(preload: str | None) -> dict:
  env = dict(os.environ)
  env.pop("LD_PRELOAD", None)
  if preload:
    env["LD_PRELOAD"] = preload
  return env


def preload_is_mapped(preload: str) -> bool:
  """Whether a Python process started with LD_PRELOAD=preload has the library mapped."""
  code = ("import sys; m = open('/proc/self/maps').read(); "
          "sys.exit(0 if sys.argv[1] in m else 1)")
  real = os.path.realpath(preload)
  return subprocess.run([sys.executable, "-c", code, real], env=_env(preload),
                        check=False).returncode == 0


def run_child(step_args: list[str], preload: str | None, out_path: str) -> dict:
  """One fresh step_benchmark process; its report and its CPU seconds and page faults."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  cmd = [
      sys.executable, "-m", "benchmarks.step_benchmark", *step_args, "--memory", "none", "--out",
      out_path
  ]
  subprocess.run(cmd, env=_env(preload), check=True, stdout=subprocess.DEVNULL,
                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  with open(out_path) as f:
    report = json.load(f)
  return dict(
      user_s=after.ru_utime - before.ru_utime, system_s=after.ru_stime - before.ru_stime,
      minor_faults=after.ru_minflt - before.ru_minflt, steps={
          f"{r['model']} n={r['n']} {r['spec']}": r["median_s"] for r in report["results"]
          if r.get("median_s")
      })


def summarize(processes: list[dict]) -> dict:
  """Per step configuration: each allocator's process medians, their mean, and the ratio
  preloaded / default of those means."""
  table = {}
  keys = sorted({k for p in processes for k in p["steps"]})
  for key in keys:
    row = {}
    for allocator in ("default", "preloaded"):
      times = [
          p["steps"][key] for p in processes if p["allocator"] == allocator and key in p["steps"]
      ]
      row[allocator] = dict(times_s=times, mean_s=statistics.fmean(times) if times else None)
    d, p = row["default"]["mean_s"], row["preloaded"]["mean_s"]
    row["ratio"] = p / d if d and p else None
    table[key] = row
  return table


def markdown(report: dict) -> str:
  lines = [
      f"Default allocator vs `LD_PRELOAD={os.path.basename(report['preload'])}`, "
      f"{report['rounds']} round(s), alternating order.", "",
      "| step | default (s) | preloaded (s) | preloaded / default |", "|---|---|---|---|"
  ]
  for key, row in report["steps"].items():
    d, p = (row[a]["mean_s"] for a in ("default", "preloaded"))
    cells = ["–" if v is None else f"{v:.3f}" for v in (d, p)]
    ratio = "–" if row["ratio"] is None else f"{row['ratio']:.2f}×"
    lines.append(f"| {key} | {cells[0]} | {cells[1]} | {ratio} |")
  lines += [
      "", "| process | allocator | user CPU s | system CPU s | minor page faults |",
      "|---|---|---|---|---|"
  ]
  for i, p in enumerate(report["processes"]):
    lines.append(f"| {i} | {p['allocator']} | {p['user_s']:.1f} | {p['system_s']:.1f} | "
                 f"{p['minor_faults']:,} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else list(argv)
  own, step_args = (argv[:argv.index("--")],
                    argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  p = argparse.ArgumentParser(prog="python -m benchmarks.allocator")
  p.add_argument("--preload", default=None, help="shared library to preload (default: tcmalloc)")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--out", default=None, help="JSON output path")
  args = p.parse_args(own)
  preload = args.preload or find_preload()
  if not preload:
    raise ValueError("no allocator to preload: install tcmalloc (Debian: libtcmalloc-minimal4) "
                     "or pass --preload=PATH")
  if not preload_is_mapped(preload):
    raise ValueError(f"LD_PRELOAD={preload} is not mapped into a new Python process")
  processes = []
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      order = ("default", "preloaded") if r % 2 == 0 else ("preloaded", "default")
      for allocator in order:
        out = os.path.join(tmp, f"{r}_{allocator}.json")
        child = run_child(step_args, preload if allocator == "preloaded" else None, out)
        processes.append(dict(round=r, allocator=allocator, **child))
        print(f"round {r} {allocator}: {child['steps']}", file=sys.stderr, flush=True)
  report = dict(schema=SCHEMA, preload=preload, rounds=args.rounds, step_args=step_args,
                load_average_end=list(os.getloadavg()), processes=processes,
                steps=summarize(processes))
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  print(markdown(report))
  return report


if __name__ == "__main__":
  main()
