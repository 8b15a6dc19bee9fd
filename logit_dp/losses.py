"""Similarity losses ℒ(Z) = Σ_i ℓ^{(i,n)}(Z_i) with known Logit-DP sensitivity."""

from logit_dp._src.losses import Contrastive
from logit_dp._src.losses import LargeSensitivityWarning
from logit_dp._src.losses import Spreadout
from logit_dp._src.losses import contrastive
from logit_dp._src.losses import spreadout

__all__ = ["Contrastive", "LargeSensitivityWarning", "Spreadout", "contrastive", "spreadout"]
