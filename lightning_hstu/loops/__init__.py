"""Lightning's loops run by the engine (the only layer, with the strategy, that uses Lightning's private API)."""

from ._lightning_compat import check_version

check_version()

from .epoch_loop import EngineEpochLoop, EngineFitLoop, install_engine_loop  # noqa: E402 (after the check)
from .errors import CheckpointError  # noqa: E402
from .step_context import StepContext  # noqa: E402

__all__ = ["CheckpointError", "EngineEpochLoop", "EngineFitLoop", "StepContext", "install_engine_loop"]
