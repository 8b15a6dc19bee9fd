"""Error messages name the arguments a user passes: every name that a ValueError or TypeError
message of the library puts before " must" or "=" is an argument (or field) of a public
signature, and make_private's messages name make_private's own arguments."""

import ast
import importlib
import inspect
import pathlib
import re

import jax
import optax
import pytest

import logit_dp

ROOT = pathlib.Path(logit_dp.__file__).parent
# logit_dp and its public modules (every logit_dp/<name>.py, contrast_clipping included).
PUBLIC_MODULES = [logit_dp] + [
    importlib.import_module(f"logit_dp.{path.stem}")
    for path in sorted(ROOT.glob("*.py")) if not path.stem.startswith("_")
]

# Keywords of the functions that grouped_clipped_grad and stochastic=True return (their
# signature is ClippedGradFn.__call__(..., **kwargs)); ClippedGradFn's docstring lists them.
CALL_KEYWORDS = ("record_ids", "group_key", "extra_views", "key")

# Names before " must" or "=" in messages that are not argument names, each with its reason.
NOT_ARGUMENTS = {
    "Z": "the similarity matrix of a loss, named by its symbol (a loss's first argument)",
    "rngs": "flax's own argument (rngs={'dropout': key}) in advice on writing embed_fn",
}


def _text(node) -> str:
  """The literal text of a message: its f-string fields as "{}"."""
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return node.value
  if isinstance(node, ast.JoinedStr):
    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    return _text(node.left) + _text(node.right)
  return "{}"


_NAMED = re.compile(r"(?<![\w.{}\[\]'\"])([A-Za-z_][A-Za-z0-9_]*)(?: must\b|=(?!=))")


def _message_names() -> dict[str, list[str]]:
  """{name: [where]} of the names before " must" or "=" in the literal text of every
  `raise ValueError(...)` / `raise TypeError(...)` of the package, and the names that helpers
  of the form ``def check(name, value)`` raising f"{name} must ..." are called with."""
  found: dict[str, list[str]] = {}
  trees = {path: ast.parse(path.read_text()) for path in sorted(ROOT.rglob("*.py"))}

  def add(name, path, node):
    found.setdefault(name, []).append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")

  helpers = set()
  for path, tree in trees.items():
    for node in ast.walk(tree):
      if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and getattr(
          node.exc.func, "id", None) in ("ValueError", "TypeError") and node.exc.args):
        continue
      for match in _NAMED.finditer(_text(node.exc.args[0])):
        add(match.group(1), path, node)
    for fn in ast.walk(tree):
      if isinstance(fn, ast.FunctionDef) and "name" in [a.arg for a in fn.args.args]:
        for node in ast.walk(fn):
          if (isinstance(node, ast.JoinedStr) and len(node.values) > 1
              and isinstance(node.values[0], ast.FormattedValue)
              and getattr(node.values[0].value, "id", None) == "name"
              and isinstance(node.values[1], ast.Constant)
              and node.values[1].value.startswith(" must")):
            helpers.add(fn.name)
  for path, tree in trees.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
            node.func, "id", None)
        if func in helpers and isinstance(node.args[0].value, str):
          add(node.args[0].value, path, node)
  return found


def _parameters(obj) -> set[str]:
  try:
    return set(inspect.signature(obj).parameters)
  except (TypeError, ValueError):
    return set()


def _public_names() -> set[str]:
  """The arguments of every public function, class (constructor and fields) and method of the
  public modules, and of the train step that `PrivateTraining.make_train_step` returns."""
  names = set()
  seen = set()

  def visit(obj):
    if id(obj) in seen:
      return
    seen.add(id(obj))
    if inspect.isclass(obj):
      names.update(_parameters(obj))
      names.update(getattr(obj, "_fields", ()))
      names.update(getattr(obj, "__dataclass_fields__", {}))
      for attr, member in vars(obj).items():
        if not attr.startswith("_") or attr == "__call__":
          if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
          if isinstance(member, property):
            names.add(attr)
          elif callable(member):
            visit(member)
    elif callable(obj):
      names.update(_parameters(obj))

  for module in PUBLIC_MODULES:
    for attr in getattr(module, "__all__", dir(module)):
      if not attr.startswith("_"):
        visit(getattr(module, attr))
  private = logit_dp.make_private(lambda p, x: x * p, logit_dp.losses.contrastive(), 1.0,
                                  target_epsilon=1.0, target_delta=1e-5, num_records=100,
                                  expected_batch_size=10, steps=1, optimizer=optax.sgd(0.1),
                                  noise_key=jax.random.key(0), sampler_seed=0)
  visit(private.make_train_step())
  for keyword in CALL_KEYWORDS:
    assert f"{keyword}=" in " ".join(logit_dp.ClippedGradFn.__doc__.split()), keyword
  return (names | set(CALL_KEYWORDS)) - {"self", "cls", "args", "kwargs"}


def test_every_name_in_a_message_is_a_public_argument():
  public = _public_names()
  found = _message_names()
  assert {"num_records", "expected_batch_size", "clip_norm", "mask"} <= set(found)
  unknown = {
      name: where for name, where in found.items()
      if name not in public and name not in NOT_ARGUMENTS
  }
  assert not unknown, ("error messages name arguments that no public signature has: "
                       f"{unknown}")
  assert not set(NOT_ARGUMENTS) & public  # a listed name that became an argument: unlist it


def _make_private(**overrides):
  args = dict(embed_fn=lambda p, x: x * p, loss=logit_dp.losses.contrastive(), clip_norm=1.0,
              target_epsilon=1.0, target_delta=1e-5, num_records=100, expected_batch_size=10,
              steps=1, optimizer=optax.sgd(0.1), noise_key=jax.random.key(0), sampler_seed=0)
  args.update(overrides)
  return logit_dp.make_private(**args)


@pytest.mark.parametrize("argument,value",
                         [("expected_batch_size", 512), ("expected_batch_size", 0),
                          ("num_records", 0), ("num_records", 2.5), ("clip_norm", -1.0),
                          ("target_epsilon", 0.0), ("target_delta", 2.0), ("steps", 0),
                          ("epochs", -1.0), ("accountant", "moments"), ("sampler_seed", -1),
                          ("mean", 1), ("overflow", "wrap"), ("max_batch_size", 0),
                          ("noise_multiplier", -1.0), ("method", "fastest"), ("group_size", 4.0),
                          ("microbatch_size", 0), ("optimizer", None), ("embed_fn", None),
                          ("noise_key", 0)])
def test_make_private_messages_name_its_own_arguments(argument, value):
  """A bad argument of make_private gets a message that names it, and every argument the
  message names is one of make_private's."""
  overrides = {argument: value}
  if argument == "epochs":
    overrides["steps"] = None
  with pytest.raises((ValueError, TypeError)) as info:
    _make_private(**overrides)
  message = str(info.value)
  assert re.search(rf"\b{argument}\b", message), message
  named = {m.group(1) for m in _NAMED.finditer(message)}
  assert named <= set(inspect.signature(logit_dp.make_private).parameters), (named, message)
