"""Training strategies (one per algorithm) behind `core.registry.STRATEGIES` (eagle3; dflash,
domino, dspark). A new algorithm is one module and a line in that registry's table."""

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
