r"""Rows per chunk of a ghost layer's pair terms on the CPU: full training steps in one process.

    python -m benchmarks.ghost_chunk_rows --sizes 256,512,1000,2000 --rows 2,4,8 --repeats 3 \
        --out docs/benchmarks/ghost_chunk_rows_cpu.json

Per batch size n (the embedding net, as `benchmarks.flagged_pairs_cost` builds it), the jitted
training steps, timed interleaved (median of --repeats): the non-private step; "ghost" as
shipped (`chunking.ghost_layer_chunk_rows`: GHOST_LAYER_CHUNK_PAIRS // n rows, between 1 and
GHOST_LAYER_CHUNK_ROWS); and "ghost" with every ghost layer's chunk capped at r rows, for each
r of --rows. Ratios to the non-private step of the same run.
"""

from __future__ import annotations

import argparse
import json

from benchmarks import flagged_pairs_cost
from benchmarks import step_benchmark as sb
from logit_dp._src import chunking


def variants(rows: list[int]) -> dict:
  out = {"non-private": (sb.BASELINE, ()), "ghost": ("ghost", ())}
  for r in rows:
    out[f"ghost, {r} row{'s' * (r != 1)}"] = ("ghost", ((chunking, "ghost_layer_chunk_rows",
                                                         lambda n, r=r: r),))
  return out


def main(argv=None) -> list:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="256,1000")
  parser.add_argument("--rows", default="2,4,8")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  rows = [int(r) for r in args.rows.split(",")]
  results = []
  for n in (int(s) for s in args.sizes.split(",")):
    result = flagged_pairs_cost.run(n, args.repeats, variants(rows))
    result["shipped_rows"] = chunking.ghost_layer_chunk_rows(n)
    results.append(result)
    print(json.dumps(results[-1]), flush=True)
  sb.write({"machine": sb.machine_info(), "code": sb.code_version(), "results": results}, args.out)
  return results


if __name__ == "__main__":
  main()
