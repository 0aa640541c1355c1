"""The Lightning this package's loops are written against, checked when they are imported.

The epoch loop and the task bodies run Lightning's own per-batch sequence (``_TrainingEpochLoop.advance``)
and automatic optimization (``_AutomaticOptimization.run``) split into the engine's steps and tasks, and
call private pieces of both. ``MIRRORED`` names each Lightning function whose source they follow or call,
with the SHA-256 of that source in the tested release: ``tests/test_lightning_compat.py`` fails when an
installed Lightning differs in any of them, so that moving to a new Lightning is a deliberate act (read
the changed functions against ``loops/``, then update the hashes and ``TESTED``).
"""

import hashlib
import importlib
import inspect

import lightning

TESTED = ((2, 6), (2, 7))
"""Lightning releases ``>= TESTED[0]`` and ``< TESTED[1]`` (also pyproject's dependency)."""

MIRRORED = {
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop.advance": "c7555c016027bd73a570e1aa8872efa0945a9c42126020ffdb9891eb5787c266",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop.run": "e8393a2170ccbe0120882038f61843f26cc9e0d78d223f87fae9f6a8fd8ea115",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor": "d4e504c3f7d8bcb54e4bd1c0689e6deedb222e676161d4da2f3ba55a4549da78",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._build_kwargs": "4a80f7e4608b7539cfb6f67269fa1affc868633ad9d585f34bf25239536e7c58",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop.on_advance_end": "2d1ddaa4e45ef5c6ee799417d23bb7f1745db28bdb7ea0ddf378c850a4dafe50",
    "lightning.pytorch.loops.fit_loop:_FitLoop.advance": "8e291f9c9323df7127b1093c4b5e2c709dbf725604d9938b1e3c9bb82e2ab903",
    "lightning.pytorch.loops.optimization.automatic:_AutomaticOptimization.run": "385b43732ecc8af33fc4eef6a70bc37d4013dd29665d72e29901c225d213d721",
    "lightning.pytorch.loops.optimization.automatic:_AutomaticOptimization._make_zero_grad_fn": "0f9b56ff1dc1a3ba995c150ce1e9a07adcd215b9f043b4d757857ca11a01038d",
    "lightning.pytorch.loops.optimization.automatic:_AutomaticOptimization._make_backward_fn": "638ca477b2752682639bcde4fc8a15543cc41fe352e2795b2522cdb43319d5e2",
    "lightning.pytorch.loops.optimization.automatic:_AutomaticOptimization._training_step": "72e8f9529eacba73750864f78e0e59a4233af66cf8eb401bc923683bf22490b5",
    "lightning.pytorch.loops.optimization.automatic:_AutomaticOptimization._optimizer_step": "e196b2fa15d19ee663aa1c42cd66675216b9c9316349d0e9b88f47f9d4605a55",
    "lightning.pytorch.loops.optimization.automatic:ClosureResult": "2da8d8114d30625200f598d8fdfbda86b53b1485adceb9ae14d9ad21e5a6b22c",
    "lightning.pytorch.loops.utilities:_block_parallel_sync_behavior": "c66548339365c2971cb9e4f2d6c9ff4fda4beffb09a51eda270263fdfe15cdeb",
    "lightning.pytorch.loops.fetchers:_DataFetcher": "6c0fe2b180a633f02377967184e64ceac2f3fac85c4ebb1c080af570f8710d50",
    "lightning.pytorch.loops.fetchers:_DataLoaderIterDataFetcher": "cd622cb22f0e5d737a3301e879108143b14dcaeaf67ee93044a57cbd39a49e27",
    "lightning.pytorch.trainer.connectors.logger_connector.logger_connector:_LoggerConnector.on_batch_start": "5022a98e255d31b5a694dfa29677ea5a4372e216ab38cbaf692444535f9e0263",
    "lightning.pytorch.trainer.connectors.logger_connector.logger_connector:_LoggerConnector.on_batch_end": "87c0a9cd43e97f9da3c0e87163f0d167a0b739ade3b71f7ad15eca78c63a47b0",
    "lightning.pytorch.trainer.connectors.logger_connector.logger_connector:_LoggerConnector.update_train_step_metrics": "44584c0c55de3464faa21a3aa765ddbd4890dc125aff469e453b38fde5b4f07e",
    "lightning.pytorch.trainer.connectors.logger_connector.result:_ResultCollection.valid_items": "ba5e622c4d38249d20c4f6dea33dbad5055ccbed422fa2437f78d031dda95bdf",
    "lightning.pytorch.trainer.connectors.logger_connector.result:_ResultCollection.update_metrics": "61e950f1f1d25eea877940bf905b4a318ce3876b6174b78865eec44de4855e54",
    "lightning.pytorch.trainer.connectors.logger_connector.result:_ResultCollection.metrics": "253a052f55f98a769c577e7fc2edb0816c60842688186229dc12bee7cdc42f49",
    "lightning.pytorch.trainer.trainer:Trainer._active_loop.fget": "d1a5c828d67439ea8c76e354b7ed76e79a575e181e74cfee2e7f67c481d369b0",
    "lightning.pytorch.trainer.connectors.data_connector:_DataHookSelector.get_instance": "3abe90f0b162ec28ced6ff909624ea0b821bbd945fe26c2fceded7fcd20f72ba",
    "lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector.register_signal_handlers": "cd4b642fd86bfc6f4168728e74aff715aa7aad92efa61a0d6a25f21a42f955ab",
    "lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector._sigterm_notifier_fn": "5f73424dfc7ee25a516a0b4cc29e5872550ea2f9b90490f508e6493364d4665b",
    "lightning.pytorch.trainer.call:_call_callback_hooks": "c413fb9a6a9ce1a31d0c48ce381076ae9113f5db9862e5a5c58e95c7282ba2f3",
    "lightning.pytorch.trainer.call:_call_lightning_module_hook": "558a87d04c4680e11dedd13657c37abf63e2da69ec5721e1cc330b6b699c2d8c",
    "lightning.pytorch.trainer.call:_call_strategy_hook": "ff429e3ac60d2a80e8e770fb77ceef59766a2a90521b5d0062a82813d279b8db",
}
"""``module:qualified.name`` -> SHA-256 of its source in the tested release."""


def installed_version() -> tuple[int, int]:
    major, minor = lightning.__version__.split(".")[:2]
    return int(major), int(minor)


def check_version() -> None:
    low, high = TESTED
    if not low <= installed_version() < high:
        raise ImportError(
            f"lightning-hstu's loops are written against Lightning >= {'.'.join(map(str, low))}, "
            f"< {'.'.join(map(str, high))}; Lightning {lightning.__version__} is installed: install a "
            f"release in that range (pip install 'lightning>={'.'.join(map(str, low))},"
            f"<{'.'.join(map(str, high))}')"
        )


def source_digest(target: str) -> str:
    """SHA-256 of the source of ``module:qualified.name``."""
    module_name, qualified = target.split(":")
    obj = importlib.import_module(module_name)
    for part in qualified.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def changed() -> dict[str, str]:
    """The mirrored functions whose installed source differs from the tested one: name -> why."""
    out = {}
    for target, digest in MIRRORED.items():
        try:
            got = source_digest(target)
        except (AttributeError, ImportError, OSError, TypeError) as error:
            out[target] = f"not found ({type(error).__name__}: {error})"
            continue
        if got != digest:
            out[target] = f"source changed (sha256 {got[:12]}..., tested {digest[:12]}...)"
    return out
