"""The parameter-linear operations of a traced embedding function, and an evaluator that
perturbs their outputs.

An embedding function Φ(w, x) is traced to a jaxpr (`trace`), and `scan` finds in it the
operations that are linear in one parameter leaf W and apply the same map to every example,
y[e, t, c] = Σ_p A[e, t, p] K[p, c], as the registered layer kinds (`layers`) recognise them:

* ``dot_general(A, W')`` with no batch dimensions ("dense"), ``conv_general_dilated(A, W')``
  with one feature group ("conv"), a ``gather`` of whole rows of W' ("embed"), and any kind
  registered since;
* optionally a bias add ``y' + B'`` with y' a reindexing of such an op's output (nothing else
  reads it) and B' a reindexing of a leaf b with B'[e, t, c] = b[c];
* elementwise sites (`ElementwiseSite`): W' multiplied with, added to or placed beside the
  examples' activations, the same for every example;

where W' (and B') is W (b) through reshape, transpose, broadcast_in_dim, squeeze,
expand_dims, copy and float32 → float32 conversions, possibly across the boundaries of
jit, closed_call, custom_jvp_call, custom_vjp_call and checkpoint sub-jaxprs. The matrix
K (P × C) must be the leaf's elements with its axes permuted (`LinearOp.kernel_axes`), so
its gradient maps back onto the leaf without a gather. Everything the scan tracks is
computed on integer index arrays, so a reindexing is recognised by what it does, not by
how it is spelt. Any other use of a leaf (or of a reindexing of it) is reported in
`Scan.other_uses`; `layerwise.make_plan` decides from these which leaves are factored.

`evaluate` runs a traced jaxpr primitive by primitive, like ``jax.core.eval_jaxpr``,
calling a hook on the recognised operations instead (and inlining only the sub-jaxprs that
contain one), so the caller can add a perturbation ξ to their outputs and record their
inputs.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from logit_dp._src.layers import base as layer_kinds

# Sub-jaxpr parameter of the call-like primitives whose bodies are scanned and inlined.
SUBJAXPR_PARAM = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
}


@dataclasses.dataclass
class LinearOp:
  """One parameter-linear operation found by `scan`.

  Canonical form: y[e, t, c] = Σ_p A[e, t, p] K[p, c], K = the kernel leaf with its axes
  permuted by `kernel_axes` and reshaped to (fan_in, features); for a convolution A[e, t]
  is the input patch of output position t (`layers.conv.conv_patches`).
  """
  path: tuple[int, ...]  # equation indices, outermost first
  kind: str  # the name of its registered `layers.LayerKind`: "dense", "conv", "embed", ...
  kernel_leaf: int
  kernel_axes: tuple[int, ...] | None  # None: the leaf is K in row-major order
  act_position: int  # operand index of A in the equation
  act_shape: tuple[int, ...]
  out_shape: tuple[int, ...]  # canonical per-example output: (*positions, features)
  fan_in: int  # P without the bias
  features: int  # C
  act_to_rows: tuple[int, ...]  # dense: A's axes as (example, positions, contracted)
  raw_to_canonical: tuple[int, ...]  # the equation's output axes in the canonical order
  conv_input_axes: tuple[int, ...] = ()  # conv: A's axes as (example, *spatial, channels)
  conv_kernel_axes: tuple[int, ...] = ()  # conv: W' axes as (*window, in, out)
  conv_config: tuple = ()  # conv: (window, strides, padding, lhs_dilation, rhs_dilation)
  precision: Any = None
  bias_leaf: int | None = None
  # The equation's feature axes (W's free axes: none, one, or several as DenseGeneral's
  # (heads, head_dim)), whose row-major flattening is the canonical feature axis c;
  # None: one axis of size features.
  feature_shape: tuple[int, ...] | None = None
  embed_clamps: bool = False  # embed: row ids out of range are clamped (else they read nothing)

  @property
  def positions(self) -> int:
    """T: the output positions per example."""
    return int(np.prod(self.out_shape[:-1], dtype=np.int64))

  @property
  def leaves(self) -> tuple[int, ...]:
    """(kernel,) or (kernel, bias) leaf indices."""
    return (self.kernel_leaf,) if self.bias_leaf is None else (self.kernel_leaf, self.bias_leaf)

  def expanded(self, canonical) -> np.ndarray | jax.Array:
    """``(m, *out_shape)`` in the canonical layout -> ``(m, *positions, *feature_shape)``."""
    if self.feature_shape is None:
      return canonical
    return canonical.reshape(canonical.shape[:-1] + tuple(self.feature_shape))

  def to_raw(self, canonical) -> jax.Array:
    """An array in the canonical output layout ``(m, *out_shape)``, in the equation's layout."""
    return jnp.transpose(self.expanded(canonical),
                         tuple(int(a) for a in np.argsort(self.raw_to_canonical)))


@dataclasses.dataclass(frozen=True, eq=False)
class ElementwiseSite:
  """A leaf W entering one elementwise equation of the examples' activations a:

      scale:  y = a ⊙ W'    ("mul"),
      shift:  y = a ± W'    ("add", "sub"), or W' placed beside a ("concatenate"),

  W' a reindexing (broadcast) of W that is the same for every example. Given δ_e = ∂û_e/∂y_e,
  the per-example Jacobian of W is a sum over the output elements p of one example,

      ∂û_e/∂W_j = Σ_{p: index[p] = j} coef_e[p]·δ_e[p],   coef = a (scale) or ±1 (shift),

  one segment sum over the elements of y (no per-example backward pass).
  """
  path: tuple[int, ...]  # equation indices, outermost first
  kind: str  # "scale" or "shift"
  leaf: int
  out_shape: tuple[int, ...]  # the equation's output, examples first
  index: np.ndarray  # (*out_shape[1:]): the leaf element of each output element of an example
  act_position: int | None = None  # scale: operand index of a
  sign: float = 1.0  # shift: +1, or −1 for W' subtracted

  @property
  def leaves(self) -> tuple[int, ...]:
    """(leaf,): the one leaf of the site."""
    return (self.leaf,)


@dataclasses.dataclass
class Scan:
  """What `scan` found: the recognised operations in evaluation order, the elementwise sites
  of leaves, and every leaf with a use that is neither (a reindexing into) one of them."""
  ops: list[LinearOp]
  other_uses: set[int]
  sites: list[ElementwiseSite] = dataclasses.field(default_factory=list)


def trace(embed_fn, params, x) -> tuple[jex.ClosedJaxpr, Any]:
  """(jaxpr, output treedef): the jaxpr of (params leaves..., x leaves...) ↦ embed_fn(params, x).

  params and x may be arrays, tracers or jax.ShapeDtypeStruct; only their types are used.
  """
  leaves, treedef = jax.tree_util.tree_flatten(params)

  def fn(leaves, x):
    return embed_fn(jax.tree_util.tree_unflatten(treedef, leaves), x)

  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(leaves, x)
  return closed, jax.tree_util.tree_structure(out_shape)


def _is_var(atom) -> bool:
  return isinstance(atom, jex.Var) and not isinstance(atom, jex.Literal)


def _reindex(eqn, index: np.ndarray) -> np.ndarray | None:
  """The index array after a reindexing equation, or None if it is not one (or one whose
  parameters this scan does not read: then its leaf takes the generic path)."""
  try:
    return _reindexed(eqn, index)
  except (ValueError, TypeError, KeyError, IndexError):
    return None


def _reindexed(eqn, index: np.ndarray) -> np.ndarray | None:
  name, params = eqn.primitive.name, eqn.params
  out_shape = tuple(eqn.outvars[0].aval.shape)
  if name == "reshape":
    if params.get("dimensions") is not None:
      return None
    return index.reshape(out_shape)
  if name == "transpose":
    return np.transpose(index, params["permutation"])
  if name == "squeeze":
    return np.squeeze(index, axis=tuple(params["dimensions"]))
  if name == "expand_dims":
    return np.expand_dims(index, tuple(params["dimensions"]))
  if name == "broadcast_in_dim":
    if len(eqn.invars) != 1:
      return None
    dims = tuple(int(d) for d in params["broadcast_dimensions"])
    shape = [1] * len(out_shape)
    for axis, size in zip(dims, index.shape):
      shape[axis] = size
    return np.broadcast_to(index.reshape(shape), out_shape)
  if name in ("copy", "copy_p"):
    return index
  if name == "convert_element_type":
    in_aval, out_aval = eqn.invars[0].aval, eqn.outvars[0].aval
    if in_aval.dtype == jnp.float32 and out_aval.dtype == jnp.float32:
      return index
  return None


def scan(closed: jex.ClosedJaxpr, num_leaves: int, leaf_shapes, with_bias: bool = True) -> Scan:
  """The recognised operations of a traced embedding (`trace`) and the leaves used otherwise.

  with_bias: also recognise bias adds (needs an index array per element of the layer
  outputs on the way to the add; callers that only evaluate can skip it).
  """
  result = Scan([], set())
  env = {
      var: (leaf, np.arange(int(np.prod(shape, dtype=np.int64)),
                            dtype=np.int32).reshape(shape), tuple(shape)
           ) for leaf, (var, shape) in enumerate(zip(closed.jaxpr.invars[:num_leaves], leaf_shapes))
  }
  _scan_jaxpr(closed.jaxpr, env, (), result, with_bias)
  return result


def _scan_jaxpr(jaxpr, env: dict, path: tuple, result: Scan, with_bias: bool) -> None:
  """Scans one (sub-)jaxpr; env maps its vars that are reindexings of a leaf to
  (leaf, index array of leaf element numbers, leaf shape)."""
  uses = collections.Counter(v for eqn in jaxpr.eqns for v in eqn.invars if _is_var(v))
  uses.update(v for v in jaxpr.outvars if _is_var(v))
  # Vars that are a bijective reindexing of a recognised op's output, read by nothing else:
  # var -> (op, the canonical feature c of every element).
  outputs: dict = {}
  for k, eqn in enumerate(jaxpr.eqns):
    here = path + (k,)
    name = eqn.primitive.name
    derived = [(pos, env[v]) for pos, v in enumerate(eqn.invars) if _is_var(v) and v in env]
    if not derived:
      if (with_bias and len(eqn.invars) == 1 and _is_var(eqn.invars[0])
          and eqn.invars[0] in outputs):
        op, canonical = outputs.pop(eqn.invars[0])
        moved = _reindex(eqn, canonical)
        if moved is not None and moved.size == canonical.size and uses[eqn.outvars[0]] == 1:
          outputs[eqn.outvars[0]] = (op, moved)
      continue
    leaves_here = {value[0] for _, value in derived}
    if name in SUBJAXPR_PARAM:
      sub = eqn.params[SUBJAXPR_PARAM[name]]
      sub_jaxpr = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
      sub_env = {
          sub_jaxpr.invars[pos]: value for pos, value in derived if pos < len(sub_jaxpr.invars)
      }
      _scan_jaxpr(sub_jaxpr, sub_env, here, result, with_bias)
      continue
    if len(eqn.invars) == 1:
      leaf, index, leaf_shape = derived[0][1]
      moved = _reindex(eqn, index)
      if moved is None:
        result.other_uses.add(leaf)
      else:
        env[eqn.outvars[0]] = (leaf, moved, leaf_shape)
      continue
    op = _recognised_op(eqn, here, derived)
    if op is not None:
      result.ops.append(op)
      if with_bias and uses[eqn.outvars[0]] == 1:  # a bias add must be its only reader
        m = op.act_shape[0]
        # The canonical feature c of every output element (bijectivity: sizes are checked).
        features = np.broadcast_to(np.arange(op.features, dtype=np.int32), (m,) + op.out_shape)
        outputs[eqn.outvars[0]] = (op,
                                   np.transpose(op.expanded(features),
                                                np.argsort(op.raw_to_canonical)))
      continue
    if with_bias and len(derived) == 1 and name in ("add", "add_any") and _bias_add(
        eqn, derived[0], outputs):
      continue
    site = _elementwise_site(eqn, here, derived)
    if site is not None:
      result.sites.append(site)
      continue
    result.other_uses |= leaves_here
  for v in jaxpr.outvars:
    if _is_var(v) and v in env:
      result.other_uses.add(env[v][0])


def _recognised_op(eqn, path, derived) -> LinearOp | None:
  """The `LinearOp` of an equation with one derived operand by the first registered layer
  kind (`layers`) of its primitive that recognises it, or None.

  An equation of a form the kinds do not expect (one this version of JAX writes differently,
  say) is not recognised rather than raising: its leaves then take the generic per-example
  Jacobians, which are exact for any JAX operation.
  """
  if len(derived) != 1:
    return None
  kernel_position, kernel = derived[0]
  for kind in layer_kinds.for_primitive(eqn.primitive.name):
    if kernel_position not in kind.kernel_operands:
      continue
    try:
      op = kind.recognise(eqn, path, kernel_position, kernel)
    except (ValueError, TypeError, KeyError, IndexError):
      op = None
    if op is not None:
      return op
  return None


def _same_for_every_example(index: np.ndarray, out_shape) -> np.ndarray | None:
  """index broadcast to out_shape, for one example (its rows along axis 0 are all equal), or
  None where it is not such a broadcast."""
  if index.ndim != len(out_shape) or not out_shape or index.shape[0] not in (1, out_shape[0]):
    return None
  try:
    full = np.broadcast_to(index, out_shape)
  except ValueError:
    return None
  if not (full == full[:1]).all():
    return None
  return np.array(full[0])


def _elementwise_site(eqn, path, derived) -> ElementwiseSite | None:
  """The `ElementwiseSite` of a mul / add / sub / concatenate with one derived operand."""
  name = eqn.primitive.name
  if len(derived) != 1 or len(eqn.outvars) != 1:
    return None
  out_aval = eqn.outvars[0].aval
  if not layer_kinds.LayerKind.all_float32(out_aval, *(v.aval
                                                       for v in eqn.invars)) or out_aval.ndim < 2:
    return None
  out_shape = tuple(int(a) for a in out_aval.shape)
  position, (leaf, index, _) = derived[0]
  try:
    if name in ("mul", "add", "add_any", "sub") and len(eqn.invars) == 2:
      other = eqn.invars[1 - position]
      if np.ndim(getattr(other, "aval", other)) not in (0, len(out_shape)):
        return None
      per_example = _same_for_every_example(index, out_shape)
      if per_example is None:
        return None
      if name == "mul":
        return ElementwiseSite(path, "scale", leaf, out_shape, per_example,
                               act_position=1 - position)
      sign = -1.0 if name == "sub" and position == 1 else 1.0
      return ElementwiseSite(path, "shift", leaf, out_shape, per_example, sign=sign)
    if name == "concatenate":
      axis = int(eqn.params["dimension"])
      if axis == 0:
        return None
      parts = [
          index if k == position else np.full(tuple(v.aval.shape), -1, index.dtype)
          for k, v in enumerate(eqn.invars)
      ]
      per_example = _same_for_every_example(np.concatenate(parts, axis=axis), out_shape)
      if per_example is None:
        return None
      return ElementwiseSite(path, "shift", leaf, out_shape, per_example)
  except (ValueError, TypeError, KeyError, IndexError):
    return None
  return None


def _bias_add(eqn, derived, outputs) -> bool:
  """Attaches a derived bias to the op whose output the add's other operand is, if
  B'[e, t, c] = b[c] and the add does not broadcast that operand."""
  position, (leaf, index, leaf_shape) = derived
  other = eqn.invars[1 - position]
  if not (_is_var(other) and other in outputs):
    return False
  op, features = outputs.pop(other)
  out_shape = tuple(eqn.outvars[0].aval.shape)
  if (op.bias_leaf is not None or tuple(features.shape) != out_shape
      or int(np.prod(leaf_shape, dtype=np.int64)) != op.features):
    return False
  try:
    bias_index = np.broadcast_to(index, out_shape)
  except ValueError:
    return False
  if not np.array_equal(bias_index, features):
    return False
  op.bias_leaf = leaf
  return True


def evaluate(closed: jex.ClosedJaxpr, args, on_op: Callable[[Any, list, Callable], Any],
             ops: Sequence[LinearOp | ElementwiseSite]) -> list:
  """Evaluates the jaxpr on args (flat), returning its flat outputs; the equation of each op
  (a `LinearOp` or an `ElementwiseSite`) in `ops` is replaced by on_op(op, its input values, a
  thunk computing the equation).
  Sub-jaxprs that contain one of them are inlined."""
  by_path = {op.path: op for op in ops}
  inline = {op.path[:k] for op in ops for k in range(1, len(op.path))}

  def substitute(eqn, here, values):
    if here in by_path:
      return [on_op(by_path[here], values, lambda: _bind(eqn, values))]
    return None

  return _evaluate(closed.jaxpr, closed.consts, args, (), substitute,
                   lambda eqn, here: here in inline)


def evaluate_substituting(closed: jex.ClosedJaxpr, args, substitute: Callable[[Any, list],
                                                                              list | None]) -> list:
  """Evaluates the jaxpr on args (flat), returning its flat outputs, with the bodies of the
  call-like primitives (`SUBJAXPR_PARAM`) inlined; substitute(eqn, input values) gives an
  equation's outputs (a list) or None to compute it as it is."""
  return _evaluate(closed.jaxpr, closed.consts, args, (),
                   lambda eqn, here, values: substitute(eqn, values),
                   lambda eqn, here: SUBJAXPR_PARAM.get(eqn.primitive.name) in eqn.params)


def _evaluate(jaxpr, consts, args, path, substitute, inline):
  env = {}

  def read(atom):
    return atom.val if isinstance(atom, jex.Literal) else env[atom]

  for var, value in zip(jaxpr.constvars, consts):
    env[var] = value
  for var, value in zip(jaxpr.invars, args):
    env[var] = value
  for k, eqn in enumerate(jaxpr.eqns):
    here = path + (k,)
    values = [read(a) for a in eqn.invars]
    outs = substitute(eqn, here, values)
    if outs is None and inline(eqn, here):
      sub = eqn.params[SUBJAXPR_PARAM[eqn.primitive.name]]
      if isinstance(sub, jex.ClosedJaxpr):
        outs = _evaluate(sub.jaxpr, sub.consts, values, here, substitute, inline)
      else:
        outs = _evaluate(sub, (), values, here, substitute, inline)
    elif outs is None:
      outs = _bind(eqn, values)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for var, value in zip(eqn.outvars, outs):
      env[var] = value  # a dropped output's entry is never read
  return [read(v) for v in jaxpr.outvars]


def _bind(eqn, values):
  with eqn.ctx.manager:
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bind_params, tuple):  # older jax: (sub-functions, params)
      subfuns, bind_params = bind_params
      return eqn.primitive.bind(*subfuns, *values, **bind_params)
    return eqn.primitive.bind(*values, **bind_params)
