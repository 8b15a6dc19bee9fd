"""Private fine-tuning: train some leaves of a params pytree, keep the others frozen.

``make_private(..., trainable=...)`` (and `logit_dp.clipped_grad`,
`logit_dp.baselines.naive_clipped_grad`, `distributed.make_sharded_grad_fn`) take which leaves are
trained: a pytree of bools with the structure of params (or a prefix of it, as the labels of
``optax.multi_transform``) or a predicate ``(path, leaf) -> bool``. The frozen leaves are closed
over in embed_fn, so the pair norms and ḡ are those of the model of the trainable leaves alone,
and they get no noise, no update and no optimizer state. The helpers here serve a loop of your
own (e.g. jax_privacy's privatizers): `trainable_mask` resolves a ``trainable`` against params,
`partition` and `combine` split and join the trainable and frozen parts, `closed` closes an
embed_fn over the frozen part, `masked_optimizer`
restricts an optax transformation to the trainable leaves. docs/guides/finetuning.md shows the
recipe; docs/PRIVACY.md ("Fine-tuning: frozen parameters") the condition on the frozen
values.
"""

from logit_dp._src.finetune import check_trainable
from logit_dp._src.finetune import closed
from logit_dp._src.finetune import combine
from logit_dp._src.finetune import masked_optimizer
from logit_dp._src.finetune import partition
from logit_dp._src.finetune import trainable_mask

__all__ = [
    "check_trainable", "closed", "combine", "masked_optimizer", "partition", "trainable_mask"
]
