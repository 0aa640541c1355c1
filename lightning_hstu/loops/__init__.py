"""Lightning's loops run by the engine (the only layer, with the strategy, that uses Lightning's private API)."""

from .epoch_loop import EngineEpochLoop, EngineFitLoop, install_engine_loop
from .errors import CheckpointError

__all__ = ["CheckpointError", "EngineEpochLoop", "EngineFitLoop", "install_engine_loop"]
