"""The privacy ledger: the steps taken and the (ε, δ) they spend (`PrivacyLedger`), a sampler
that refuses the steps the budget does not allow (`BudgetedSampler`), and orbax checkpoints that
save and restore the ledger with the training state."""

from logit_dp._src.ledger import LEDGER_FORMAT_VERSION
from logit_dp._src.ledger import UNITS
from logit_dp._src.ledger import BudgetedPersonSampler
from logit_dp._src.ledger import BudgetedSampler
from logit_dp._src.ledger import PrivacyBudgetExceededError
from logit_dp._src.ledger import PrivacyLedger
from logit_dp._src.ledger import accountant_delta
from logit_dp._src.ledger import latest_step
from logit_dp._src.ledger import restore_checkpoint
from logit_dp._src.ledger import restore_sampler
from logit_dp._src.ledger import save_checkpoint

__all__ = [
    "BudgetedPersonSampler",
    "BudgetedSampler",
    "LEDGER_FORMAT_VERSION",
    "PrivacyBudgetExceededError",
    "PrivacyLedger",
    "UNITS",
    "accountant_delta",
    "latest_step",
    "restore_checkpoint",
    "restore_sampler",
    "save_checkpoint",
]
