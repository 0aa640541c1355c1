"""Third-party warnings that are known to be harmless here and that this package cannot remove at their
source, silenced by their exact message (nothing else is filtered). Imported by the modules that import
those dependencies, before they do."""

import logging
import warnings

# megatron-core without Transformer Engine and Apex (the CPU install, and any GPU install without them)
# uses its own PyTorch implementations of the fused kernels; it says so once per module that imports them.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)

# Lightning 2.6 flattens batches with torch's LeafSpec, which torch 2.13 deprecates: Lightning's to fix.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

# TorchRec's sharded tables are ShardedTensors, which torch's distributed checkpoint says it deprecates on
# every load of one (a prediction from a checkpoint loads them): TorchRec's to move to DTensor.
warnings.filterwarnings(
    "ignore", message="Please use DTensor instead and we are deprecating ShardedTensor", category=FutureWarning
)


class _FxTracingNotice(logging.Filter):
    """TorchRec's embedding lookup asks torch.fx whether it is being traced, and torch logs a notice about
    that question's meaning under torch.export; nothing here is traced or exported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_FxTracingNotice())
