"""One private update, the same for every train step: ḡ → optimizer (the noise first) → params.

`PrivateTraining.make_train_step` (one device or a mesh) and
`distributed.make_private_train_step` both jit this function around their own checks.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from logit_dp._src import finetune


def private_update(grad_fn, optimizer: optax.GradientTransformation, params: Any, opt_state: Any,
                   x: Any, x_prime: Any, mask: Any, *, clip_stats: bool = False,
                   **grad_kwargs) -> tuple[Any, Any, Any, Any, Any]:
  """(params, opt_state, ℒ, num_dropped, stats) after one update of ``optimizer`` with ḡ.

  (ℒ, ḡ) = grad_fn(params, x, x_prime, mask, **grad_kwargs) (``grad_fn.with_num_dropped``
  where it has it: valid rows with non-finite inputs or embeddings are masked out and
  counted); with clip_stats, ``grad_fn.with_stats`` and stats its NON-PRIVATE `ClipStats`
  (None otherwise). The optimizer adds the noise first (`logit_dp.transform`). A grad_fn built
  with ``trainable=`` (fine-tuning) gets its frozen leaves back exactly as they were.
  """
  stats = None
  if clip_stats:
    loss_value, grads, stats = grad_fn.with_stats(params, x, x_prime, mask, **grad_kwargs)
    num_dropped = stats.num_dropped
  elif hasattr(grad_fn, "with_num_dropped"):
    loss_value, grads, num_dropped = grad_fn.with_num_dropped(params, x, x_prime, mask,
                                                              **grad_kwargs)
  else:
    loss_value, grads = grad_fn(params, x, x_prime, mask, **grad_kwargs)
    num_dropped = jnp.zeros((), jnp.int32)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  new_params = finetune.keep_frozen(optax.apply_updates(params, updates), params,
                                    getattr(grad_fn, "trainable", None))
  return new_params, opt_state, loss_value, num_dropped, stats
