"""Poisson batch sampling, padded to a fixed size (what the accounting assumes:
`PoissonSampler`; per person: `PersonPoissonSampler`), and shuffled batches for non-private
training (`ShuffledBatcher`)."""

from logit_dp._src.sampling import DEFAULT_OVERFLOW_PROBABILITY
from logit_dp._src.sampling import OVERFLOW_POLICIES
from logit_dp._src.sampling import BatchOverflowError
from logit_dp._src.sampling import PersonPoissonSampler
from logit_dp._src.sampling import PoissonBatch
from logit_dp._src.sampling import PoissonSampler
from logit_dp._src.sampling import ShuffledBatcher
from logit_dp._src.sampling import check_overflow
from logit_dp._src.sampling import inclusion_threshold
from logit_dp._src.sampling import max_batch_size_for
from logit_dp._src.sampling import overflow_delta
from logit_dp._src.sampling import overflow_probability
from logit_dp._src.sampling import overflow_term
from logit_dp._src.sampling import person_max_batch_size_for
from logit_dp._src.sampling import person_overflow_probability
from logit_dp._src.sampling import person_poisson_batch
from logit_dp._src.sampling import poisson_batch

__all__ = [
    "BatchOverflowError",
    "DEFAULT_OVERFLOW_PROBABILITY",
    "OVERFLOW_POLICIES",
    "PersonPoissonSampler",
    "PoissonBatch",
    "PoissonSampler",
    "ShuffledBatcher",
    "check_overflow",
    "inclusion_threshold",
    "max_batch_size_for",
    "overflow_delta",
    "overflow_probability",
    "overflow_term",
    "person_max_batch_size_for",
    "person_overflow_probability",
    "person_poisson_batch",
    "poisson_batch",
]
