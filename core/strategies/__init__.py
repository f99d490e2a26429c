"""Training strategies (one per algorithm) behind a registry; importing this package registers
the built-in ones (eagle3; dflash, domino, dspark). A new algorithm is one module that calls
`register_strategy` and an import here."""

from specbus.core.strategies import dflash as _dflash  # noqa: F401  (registers dflash, domino, dspark)
from specbus.core.strategies import eagle3 as _eagle3  # noqa: F401  (registers "eagle3")
from specbus.core.strategies.base import (
    FeatureContract,
    FeatureField,
    StepContext,
    Strategy,
    TrainBatch,
    available_strategies,
    build_strategy,
    register_strategy,
)

__all__ = [
    "FeatureContract",
    "FeatureField",
    "StepContext",
    "Strategy",
    "TrainBatch",
    "available_strategies",
    "build_strategy",
    "register_strategy",
]
