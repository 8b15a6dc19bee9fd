"""The path from a training step to the user's model through the library's modules.

Runs the first step of `make_private`'s train step (its checks, its trace, its compile) on a
model of `benchmarks.transformers` and records, with `sys.setprofile`, every chain of the
library's functions on the call stack when the model is called. Their union is a tree rooted at
the step, each function once (a loop over 14 layers is one branch). Read depth first, as a
newcomer follows it, the tree is a path through modules: a *stop* is a stretch of it in one
module, a *return* a stop in a module the path has visited before (stops = modules + returns),
and going back up from a branch to a function of another module is a stop there too. The
model's own code and JAX's are not stops.

Prints the stops, the modules, the returns, the functions of the tree and the stops per module
(`--tree` also prints the tree).

```
python -m benchmarks.pipeline_path --arch text --method ghost
```
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax

import logit_dp
from benchmarks import transformers

_PACKAGE = os.path.dirname(os.path.abspath(logit_dp.__file__))


def _module(filename: str) -> str | None:
  """The dotted module of a file of the package, or None for any other file."""
  path = os.path.abspath(filename)
  if not path.startswith(_PACKAGE + os.sep):
    return None
  relative = os.path.relpath(path, os.path.dirname(_PACKAGE))
  return relative[:-len(".py")].replace(os.sep, ".")


def _name(code) -> tuple[str, str]:
  return _module(code.co_filename), code.co_qualname


def model_chains(fn, model_code, *args) -> list[tuple[tuple[str, str], ...]]:
  """The distinct chains of the package's functions ((module, qualified name), outermost
  first) on the stack each time code object `model_code` is entered while fn(*args) runs, in
  the order they first occur."""
  chains: dict = {}

  def profile(frame, event, _):
    if event != "call" or frame.f_code is not model_code:
      return
    chain, caller = [], frame.f_back
    while caller is not None:
      if _module(caller.f_code.co_filename) is not None:
        chain.append(_name(caller.f_code))
      caller = caller.f_back
    chain = tuple(reversed(chain))
    chains.setdefault(chain, None)

  sys.setprofile(profile)
  try:
    fn(*args)
  finally:
    sys.setprofile(None)
  return list(chains)


def tree(chains) -> dict:
  """The chains merged into a tree: {node: {child: {...}}}, children in first-seen order."""
  root: dict = {}
  for chain in chains:
    node = root
    for function in chain:
      node = node.setdefault(function, {})
  return root


def walk(root: dict) -> list[str]:
  """The module path of a depth-first walk of the tree, consecutive repeats merged (a step
  back up to a parent is a stop in the parent's module)."""
  modules: list[str] = []

  def visit(function, children):
    if not modules or modules[-1] != function[0]:
      modules.append(function[0])
    for child, grandchildren in children.items():
      visit(child, grandchildren)
      if modules[-1] != function[0]:
        modules.append(function[0])

  for function, children in root.items():
    visit(function, children)
  return modules


def summary(chains) -> dict:
  """{"stops", "modules", "returns", "functions", "per_module"} of the chains' tree."""
  root = tree(chains)
  path = walk(root)
  per_module = collections.Counter(path)
  functions = {function for chain in chains for function in chain}
  return {
      "stops": len(path),
      "modules": len(per_module),
      "returns": len(path) - len(per_module),
      "functions": len(functions),
      "per_module": dict(per_module.most_common()),
  }


def step_chains(arch: str, method: str, n: int = 16) -> list:
  """The chains from the first train step of `make_private(method=method)` on `arch` to the
  model."""
  embed_fn, params, x, x_prime, positive_embed_fn = transformers.build("linen", arch, n)

  def model(params, x):
    return embed_fn(params, x)

  def positive_model(params, x):
    return positive_embed_fn(params, x)

  extra = {} if positive_embed_fn is None else {"positive_embed_fn": positive_model}
  private = logit_dp.make_private(model, logit_dp.losses.contrastive(temperature=0.5), 1.0,
                                  target_epsilon=8.0, target_delta=1e-5, num_records=4 * n,
                                  expected_batch_size=n, steps=1, optimizer=optax.sgd(0.1),
                                  method=method, noise_key=jax.random.key(0), sampler_seed=0,
                                  **({"group_size": 2} if method == "dp_gcl" else {}), **extra)
  step = private.make_train_step()
  opt_state = private.optimizer.init(params)
  batch = next(iter(private.batches()))
  records = (jnp.concatenate([x] * 4), jnp.concatenate([x_prime] * 4))
  return model_chains(step, model.__code__, params, opt_state, batch, records)


def _print_tree(root: dict, depth: int = 0) -> None:
  for (module, function), children in root.items():
    print(f"{'  ' * depth}{module.removeprefix('logit_dp.')}.{function}")
    _print_tree(children, depth + 1)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--arch", default="text", choices=("text", "vit", "clip"))
  parser.add_argument("--method", default="ghost")
  parser.add_argument("--tree", action="store_true", help="print the tree")
  parser.add_argument("--out", default=None, help="write the summary and the chains as JSON")
  args = parser.parse_args(argv)
  chains = step_chains(args.arch, args.method)
  if args.tree:
    _print_tree(tree(chains))
  result = summary(chains)
  print(json.dumps({k: v for k, v in result.items() if k != "per_module"}))
  for module, count in result["per_module"].items():
    print(f"{count:4d}  {module}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
          dict(result, arch=args.arch, method=args.method,
               chains=[[f"{m}.{fn}" for m, fn in chain] for chain in chains]), f, indent=1)


if __name__ == "__main__":
  main()
