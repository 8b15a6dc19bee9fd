"""Similarity losses ℒ(Z) = Σ_i ℓ^{(i,n)}(Z_i) with a known Logit-DP sensitivity, and the
cosine similarity Z_ij = ⟨n(u_i), n(v_j)⟩ they take (n(u) = u/√(‖u‖² + ε²)), and the
Logit-DP sensitivity of one person with up to K pairs (`person_sensitivity`)."""

from logit_dp._src.losses import Contrastive
from logit_dp._src.losses import LargeSensitivityWarning
from logit_dp._src.losses import Spreadout
from logit_dp._src.losses import contrastive
from logit_dp._src.losses import spreadout
from logit_dp._src.numerics import DEFAULT_COSINE_EPS
from logit_dp._src.numerics import cosine_similarity
from logit_dp._src.numerics import normalize
from logit_dp._src.sensitivity import person_sensitivity

__all__ = [
    "Contrastive",
    "DEFAULT_COSINE_EPS",
    "LargeSensitivityWarning",
    "Spreadout",
    "contrastive",
    "cosine_similarity",
    "normalize",
    "person_sensitivity",
    "spreadout",
]
