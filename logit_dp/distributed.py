"""Data-parallel Logit-DP across devices and hosts: the batch split along a mesh axis
(`data_mesh`, `shard_batch`), the pair matrix spanning the global batch
(`make_sharded_grad_fn`), and the low-level private step (`make_private_train_step`).
``logit_dp.make_private(..., mesh=data_mesh())`` sets up the whole private training on a mesh."""

from logit_dp._src.distributed import DATA_AXIS
from logit_dp._src.distributed import broadcast_seed
from logit_dp._src.distributed import data_mesh
from logit_dp._src.distributed import local_batch_indices
from logit_dp._src.distributed import make_private_optimizer
from logit_dp._src.distributed import make_private_train_step
from logit_dp._src.distributed import make_sharded_grad_fn
from logit_dp._src.distributed import pad_to_multiple
from logit_dp._src.distributed import replicate
from logit_dp._src.distributed import resolve_devices
from logit_dp._src.distributed import shard_batch

__all__ = [
    "DATA_AXIS",
    "broadcast_seed",
    "data_mesh",
    "local_batch_indices",
    "make_private_optimizer",
    "make_private_train_step",
    "make_sharded_grad_fn",
    "pad_to_multiple",
    "replicate",
    "resolve_devices",
    "shard_batch",
]
