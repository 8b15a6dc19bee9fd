"""Stochastic embedding functions: dropout, stochastic depth, random augmentation inside the model.

A stochastic model is ``embed_fn(params, x, key) -> (n, d)``, declared with ``stochastic=True``
on the builder (`logit_dp.clipped_grad`, `logit_dp.baselines.naive_clipped_grad`, ...); its gradient
function then takes ``key=`` at every call. From that one key every example gets its own,

    k_i = fold_in(fold_in(key, view), i)    (view 0: x, 1: x_prime, 2: public reference inputs),

i the example's row in the global batch (over every device of a sharded batch), and is
embedded alone with it: Φ(x_i; k_i) = embed_fn(params, x_i[None], k_i)[0] (vmapped over the
examples), so a model that draws one dropout mask "for the batch" still draws an independent
one per example. The keys travel with the examples as one more input leaf (`Keyed`): every
recomputation of an example's embedding (forward pass, Jacobian factors, backward passes,
per-pair gradients, microbatch chunks, the rows another device gathers) sees the same k_i,
so the pair norms and ḡ are those of one function per example.

Formal guarantees. Conditioned on the keys, Z_ij = ⟨n(Φ(x_i; k_i)), n(Φ'(x'_j; k'_j))⟩
depends on pair i's and pair j's own examples only, and every clipped pair gradient has norm
≤ B; the sensitivity proof of `logit_dp.sensitivity` uses nothing else, so ḡ has the same
sensitivity C for every value of the keys. If the key is fresh at every step, independent of
the noise key and of the data, and never released, the per-example keys are i.i.d. and
independent of which records are sampled; attaching them to the records (a record keeps its
keys when another is added or removed) couples the mechanism on neighbouring datasets, so it
is a mixture, over the same distribution of keys, of Gaussian mechanisms of sensitivity C.
By joint convexity of the hockey-stick divergence the mixture is (ε, δ)-DP whenever every
component is: the accounting of a deterministic model applies unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

VIEW_X, VIEW_X_PRIME, VIEW_REFERENCE = 0, 1, 2

# embed_fn(params, x, key) -> (n, d): a model drawing its randomness from key.
StochasticEmbedFn = Callable[[Any, Any, jax.Array], jax.Array]


class Keyed(NamedTuple):
  """Inputs with one PRNG key per example, as key data (n, *key_shape) uint32."""
  inputs: Any
  keys: jax.Array


def is_typed_key(key) -> bool:
  """Whether key is a typed JAX key (`jax.random.key`) rather than raw uint32 key data."""
  return jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key)


def check_stochastic(stochastic) -> bool:
  """stochastic if True or False; ValueError otherwise."""
  if not isinstance(stochastic, bool):
    raise ValueError(f"stochastic must be True or False, got {stochastic!r}.")
  return stochastic


def arity_error(name: str, stochastic: bool) -> TypeError:
  """The TypeError of an embedding function whose arguments do not match ``stochastic``."""
  if stochastic:
    return TypeError(
        f"{name} was declared stochastic=True, so it is called as {name}(params, x, key), but "
        "it does not take a key: drop stochastic=True for a deterministic "
        f"{name}(params, x), or give it the key argument, {name}(params, x, key), and draw its "
        "randomness from it (e.g. rngs={'dropout': key}).")
  return TypeError(
      f"{name} requires a third argument, but without stochastic=True it is called as "
      f"{name}(params, x): for a stochastic model {name}(params, x, key) (dropout) pass "
      "stochastic=True (the gradient function then takes key= at every call), or drop the "
      "key argument.")


def check_signature(embed_fn, stochastic: bool, name: str = "embed_fn") -> None:
  """TypeError (`arity_error`) when embed_fn's signature cannot be called as
  embed_fn(params, x, key) (stochastic) or embed_fn(params, x) (deterministic).

  A signature that accepts both (``*args``, as flax's ``Module.apply``) or none that Python can
  read passes here; `arity_error` is raised on the first call instead (`checks.check_embed_fn`).
  """
  try:
    signature = inspect.signature(embed_fn)
  except (TypeError, ValueError):  # builtins, some C extensions
    return
  try:
    signature.bind(*(None,) * (3 if stochastic else 2))
  except TypeError:
    raise arity_error(name, stochastic) from None


def called_with_other_arity(embed_fn, params, x, key) -> bool:
  """Whether embed_fn runs when called the other way than ``key`` says: embed_fn(params, x)
  for a key, embed_fn(params, x, key0) without one (key0 a fixed probe key). For diagnosing a
  TypeError of the first call."""
  try:
    if key is None:
      embed_fn(params, x, jax.random.key(0))
    else:
      embed_fn(params, x)
  except Exception:  # pylint: disable=broad-except
    return False
  return True


def check_key(key, stochastic: bool, what: str) -> Any:
  """key for a stochastic function (None for a deterministic one).

  TypeError when a stochastic function gets no key or a deterministic one gets one; ValueError
  unless key is one JAX PRNG key (a typed key of shape () or raw key data, uint32 of shape (2,)).
  """
  if not stochastic:
    if key is not None:
      raise TypeError(f"{what} was built for a deterministic embed_fn(params, x) and takes no "
                      "key; build it with stochastic=True for an embed_fn(params, x, key) "
                      "(dropout, stochastic depth).")
    return None
  if key is None:
    raise TypeError(f"{what} was built with stochastic=True and needs key=: a fresh JAX PRNG "
                    "key at every step, independent of the noise key and never released "
                    "(docs/PRIVACY.md).")
  if is_typed_key(key):
    if jnp.shape(key) != ():
      raise ValueError(f"key must be one PRNG key, got a key array of shape {jnp.shape(key)}.")
    return key
  if not hasattr(key, "dtype") or jnp.result_type(key) != jnp.uint32 or jnp.shape(key) != (2,):
    raise ValueError("key must be a JAX PRNG key (jax.random.key(seed) or "
                     f"jax.random.PRNGKey(seed)), got {getattr(key, 'dtype', type(key))} of shape "
                     f"{jnp.shape(key)}.")
  return jnp.asarray(key)


def example_keys(key, view: int, rows: jax.Array) -> jax.Array:
  """Key data of fold_in(fold_in(key, view), i) for every global row i: (len(rows), *key_shape)."""
  base = jax.random.fold_in(key, view)
  keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(rows)
  return jax.random.key_data(keys) if is_typed_key(key) else keys


def attach(x, key, view: int, rows: jax.Array) -> Keyed:
  """x with the keys `example_keys(key, view, rows)` of its examples."""
  return Keyed(x, example_keys(key, view, rows))


@dataclasses.dataclass(frozen=True)
class PerExample:
  """embed(params, Keyed(x, keys)) -> (n, d): each example embedded alone with its own key.

  Row e is stochastic_fn(params, x[e:e+1], k_e)[0], vmapped over the examples. Hashable (a
  static argument of jitted functions); key_impl is that of the user's typed key (None: the
  keys are handed to stochastic_fn as raw key data).
  """
  stochastic_fn: StochasticEmbedFn
  key_impl: Any = None

  def __call__(self, params, keyed: Keyed) -> jax.Array:
    """(n, d): row e embedded alone with key e."""
    def one(x_one, k):
      if self.key_impl is not None:
        k = jax.random.wrap_key_data(k, impl=self.key_impl)
      out = self.stochastic_fn(params, jax.tree_util.tree_map(lambda a: a[None], x_one), k)
      return out[0]

    return jax.vmap(one)(keyed.inputs, keyed.keys)


def key_impl(key) -> Any:
  """The PRNG implementation of a typed key (None for raw key data)."""
  return jax.random.key_impl(key) if is_typed_key(key) else None


def is_stochastic(*embed_fns) -> bool:
  """Whether any of the engine's embedding functions is a stochastic model's (`bind`)."""
  return any(isinstance(fn, PerExample) for fn in embed_fns)


def bind(embed_fn, positive_embed_fn, key, x, x_prime, rows: jax.Array) -> tuple:
  """(embed_fn, positive_embed_fn, x, x_prime) as the engine sees them.

  key None (a deterministic model): unchanged. Otherwise the `PerExample` functions of the
  stochastic ones and x, x_prime `Keyed` with the keys of their global rows (views 0 and 1).
  """
  if key is None:
    return embed_fn, positive_embed_fn, x, x_prime
  impl = key_impl(key)
  anchor = PerExample(embed_fn, impl)
  positive = None if positive_embed_fn is None else (
      anchor if positive_embed_fn is embed_fn else PerExample(positive_embed_fn, impl))
  return (anchor, positive, attach(x, key, VIEW_X, rows), attach(x_prime, key, VIEW_X_PRIME, rows))


def reference_inputs(inputs, key) -> Any:
  """Public reference inputs as the engine sees them: `Keyed` with view 2 (a stochastic
  model) or unchanged (key None)."""
  if key is None:
    return inputs
  n = jax.tree_util.tree_leaves(inputs)[0].shape[0]
  return attach(inputs, key, VIEW_REFERENCE, jnp.arange(n))
