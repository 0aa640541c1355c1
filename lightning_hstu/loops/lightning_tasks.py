"""Task bodies that do what Lightning's automatic optimization does, cut at the engine's task boundaries.

Lightning runs training_step, zero_grad and backward inside a closure it hands to ``optimizer.step``.
Here they are separate tasks built from Lightning's own pieces (``_make_zero_grad_fn``,
``_training_step``, ``_make_backward_fn``, ``_optimizer_step``), and ``optimizer_step`` gets a closure
that returns the loss already computed. The hooks therefore run in this order: on_before_zero_grad,
optimizer_zero_grad, training_step, backward hooks, optimizer_step, on_before_optimizer_step, gradient
clipping, step; weights come out the same as under Lightning's loop, unless ``training_step`` reads the
parameters' gradients (Lightning's still holds the previous step's there; here they are cleared).

Tasks a plain LightningModule has nothing for (the shuffle, TorchRec input dist, prefetch, global token
count, gradient finalisation, watchdog) get a body generated from their definition, which passes the batch
through and is recorded as skipped. A module that defines ``hstu_<task>(batch)`` for one of them
(``HSTU_HOOKS``) gets that method run as the task's body: it receives the task's ``BatchView`` and writes the
task's slots.
"""

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from lightning.pytorch.utilities.rank_zero import WarningCache

from ..engine import SKIPPED, BatchView
from ..hstu.tasks import HSTU_TASK_NAMES
from ..plan import Plan, PlanTask
from .step_context import StepContext

_warnings = WarningCache()

LIGHTNING_BODIES = ("h2d", "zero_grad", "forward", "backward", "optimizer_step")
"""Tasks whose body is Lightning's own (``LightningTasks``' methods of the same names)."""

HSTU_HOOKS = tuple(name for name in HSTU_TASK_NAMES if name not in LIGHTNING_BODIES)
"""Tasks a LightningModule may implement as ``hstu_<task>(self, batch)``; the others are Lightning's own."""

UNSHUFFLED = {"shuffled_batch": "device_batch"}
"""Without a shuffle of the module's own, each rank trains on the batch its loader gave it."""


class StepLoss(ClosureResult):
    """Lightning's ``ClosureResult`` of a ``training_step``, less its division of the loss by
    ``accumulate_grad_batches`` when that is 1: the loss divided by 1 is the same value, and the division was a
    kernel in the forward, an autograd node and a kernel in the backward of every step. Backward receives the
    loss that ``training_step`` returned; with accumulation, Lightning's division is kept."""

    @classmethod
    def from_training_step_output(cls, output: Any, normalize: int = 1) -> ClosureResult:
        if normalize == 1 and isinstance(output, torch.Tensor):
            return cls(output)
        if normalize == 1 and isinstance(output, Mapping) and output.get("loss") is not None:
            return cls(output["loss"], extra={k: v for k, v in output.items() if k != "loss"})
        return super().from_training_step_output(output, normalize)


@dataclass
class TrainBatch:
    """Lightning's state for the batch at lookahead 0, prepared on the caller's thread before its step."""

    batch_idx: int
    """Lightning's batch index in the epoch, which is also the engine's batch (and step) index."""
    kwargs: OrderedDict
    """Arguments of ``training_step``."""
    should_accumulate: bool
    """Accumulate gradients: no optimizer step, no gradient sync after this batch."""
    context: StepContext
    """What ``training_step`` reads of its step (``trainer.strategy.step_context``)."""
    skip: bool = False
    """The loader yielded None: Lightning warns and trains nothing on this batch."""
    result: ClosureResult | None = None
    stepped: bool = False
    """The optimizer step of this batch has been applied (its task returned)."""
    no_sync: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """Holds DDP's no_sync from forward to the end of backward while accumulating."""


class LightningTasks:
    """Bodies for every HSTU task, for an ordinary LightningModule with automatic optimization."""

    def __init__(self, trainer: "pl.Trainer"):
        self.trainer = trainer
        self.current: TrainBatch | None = None
        # Lightning's hook machinery (`_current_fx_name`, profilers, the result collection) is not
        # thread-safe; the tasks that call into it hold this lock. Only lookahead-0 tasks do.
        self._lightning = threading.RLock()

    def bodies(self, plan: Plan) -> dict[str, Any]:
        """A body for every task of ``plan``: Lightning's own, the module's ``hstu_<task>`` method, or else
        a pass-through."""
        module = self.trainer.lightning_module
        bodies = {}
        for task in plan.tasks:
            hook = getattr(module, f"hstu_{task.name}", None)
            if task.name in LIGHTNING_BODIES:
                bodies[task.name] = getattr(self, task.name)
            elif task.name == "finalize_model_grads" and callable(hook):
                bodies[task.name] = self._at_optimizer_steps(task, hook)
            elif task.name in HSTU_HOOKS and callable(hook):
                bodies[task.name] = hook
            else:
                bodies[task.name] = _passthrough(task, UNSHUFFLED)
        return bodies

    # ----- the io side: runs ahead, on another thread, so it must not touch Lightning's hook state ---

    def h2d(self, b: BatchView) -> None:
        """Lightning's batch transfer: convert_input, then the strategy's ``batch_to_device`` (which, in
        HSTUPipelineStrategy, runs the transfer hooks without touching Lightning's hook state: this task runs
        on another thread than training_step)."""
        trainer = self.trainer
        strategy = trainer.strategy
        batch = trainer.precision_plugin.convert_input(b["batch"])
        b["device_batch"] = strategy.batch_to_device(batch, strategy.root_device, dataloader_idx=0)

    # ----- lookahead 0: what Lightning's automatic optimization does --------------------------------

    def zero_grad(self, b: BatchView) -> Any:
        batch = self._batch(b)
        if batch.skip:
            b["grads_cleared"] = False
            return SKIPPED
        with self._lightning:
            zero_grad = self._automatic._make_zero_grad_fn(batch.batch_idx, self._optimizer)
            if zero_grad is None:  # inside an accumulation window
                b["grads_cleared"] = False
                return SKIPPED
            zero_grad()
        b["grads_cleared"] = True

    def forward(self, b: BatchView) -> Any:
        batch = self._batch(b)
        if batch.skip:
            b["loss"] = None
            return SKIPPED
        strategy = self.trainer.strategy
        with self._lightning:
            if self._accumulating(batch):
                batch.no_sync.enter_context(_block_parallel_sync_behavior(strategy, block=True))
            batch.result = self._automatic._training_step(batch.kwargs)
        b["loss"] = batch.result

    def backward(self, b: BatchView) -> Any:
        batch = self._batch(b)
        b["grads"] = not batch.skip
        if batch.skip:
            return SKIPPED
        result: ClosureResult = b["loss"]
        with self._lightning, batch.no_sync:
            if result.closure_loss is None:
                _warnings.warn("`training_step` returned `None`. If this was on purpose, ignore this warning...")
            else:
                backward = self._automatic._make_backward_fn(self._optimizer)
                if backward is not None:
                    backward(result.closure_loss)

    def optimizer_step(self, b: BatchView) -> Any:
        batch = self._batch(b)
        accumulating = self._accumulating(batch)
        b["stepped"] = not (accumulating or batch.skip)
        if accumulating or batch.skip:
            return SKIPPED
        result = batch.result
        with self._lightning:
            # Lightning's optimizer_step hook, precision plugin and gradient clipping run as usual; the
            # closure they call returns the loss that forward and backward already produced.
            self._automatic._optimizer_step(batch.batch_idx, lambda: result.loss)
        batch.stepped = True

    def _at_optimizer_steps(self, task: PlanTask, hook):
        """The module's ``hstu_finalize_model_grads``, run only for the batches that end in an optimizer step:
        inside an accumulation window Lightning neither syncs nor steps, and a finalisation there (a gradient
        all-reduce, ``.grad`` pointed at a buffer the next backward adds into, clipping) would act on a
        partial sum. The same on every rank (the window depends on the batch index only)."""

        def body(b: BatchView) -> Any:
            if self._accumulating(self._batch(b)):
                for slot in task.writes:
                    b[slot] = None
                return SKIPPED
            return hook(b)

        return body

    # ----- helpers ---------------------------------------------------------------------------------

    def _accumulating(self, batch: TrainBatch) -> bool:
        return batch.should_accumulate and not self.trainer.strategy.handles_gradient_accumulation

    @property
    def _automatic(self):
        return self.trainer.fit_loop.epoch_loop.automatic_optimization

    @property
    def _optimizer(self):
        return self.trainer.optimizers[0]

    def _batch(self, b: BatchView) -> TrainBatch:
        batch = self.current
        if batch is None or batch.batch_idx != b.index:
            # The caller prepares batch k before step k; anything else is an engine bug, not user error.
            raise RuntimeError(
                f"lookahead-0 task got batch {b.index}, but the loop prepared "
                f"{None if batch is None else batch.batch_idx}"
            )
        return batch


def _passthrough(task: PlanTask, copies: dict[str, str]):
    """A body for a task with nothing to do, from its definition: each slot it writes gets the slot that
    ``copies`` names for it (written slot -> read slot) where the task reads that one, else None, so that
    its consumers run; the task is recorded as skipped. None (no body) when it writes nothing."""
    if not task.writes:
        return None
    sources = {slot: copies[slot] if copies.get(slot) in task.reads else None for slot in task.writes}

    def body(b: BatchView) -> Any:
        for slot, source in sources.items():
            b[slot] = None if source is None else b[source]
        return SKIPPED

    return body
