"""Lightning strategies. Importing this package registers "hstu_<preset>" for every preset."""

from lightning.pytorch.strategies import StrategyRegistry

from .hstu_pipeline import HSTUPipelineStrategy

HSTUPipelineStrategy.register_strategies(StrategyRegistry)

__all__ = ["HSTUPipelineStrategy"]
