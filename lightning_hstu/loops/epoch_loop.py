"""Lightning's training epoch loop, run by the engine.

Lightning's own per-batch sequence is kept, split around the engine's steps: before step ``k`` (on the
caller's thread, no task running) batch ``k`` is announced (progress ``ready``, logger, the
``on_train_batch_start`` hooks, ``started``); during step ``k`` the engine runs its lookahead-0 tasks
(zero_grad, training_step, backward, optimizer_step) while other threads prepare the next batches;
after step ``k`` batch ``k`` is finished (``processed``, LR schedulers, ``on_train_batch_end`` hooks,
``completed``, metrics) and validation, checkpointing and early stopping run as usual.
"""

import contextlib
import threading
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.loops.fetchers import _DataFetcher, _DataLoaderIterDataFetcher
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import WarningCache
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from typing_extensions import override

from ..engine import Engine, StepResult, TaskRecord
from .epoch_batches import BATCH_SIZES_KEY, WORLD_SIZE_KEY, EpochBatches, new_pass, record_shares
from .errors import CheckpointError
from .hook_calls import skipping_idle_hooks
from .lightning_tasks import LightningTasks, StepLoss, TrainBatch
from .step_context import StepContext

if TYPE_CHECKING:
    from ..strategies.hstu_pipeline import HSTUPipelineStrategy

_warnings = WarningCache()


class EngineEpochLoop(_TrainingEpochLoop):
    """Owns the engine: starts it at the first epoch, runs an engine step per batch, closes it at teardown
    (or when the strategy reports an exception)."""

    def __init__(self, trainer, min_steps, max_steps, strategy: "HSTUPipelineStrategy"):
        super().__init__(trainer, min_steps, max_steps)
        self._strategy = strategy
        self._tasks = LightningTasks(trainer)
        self.automatic_optimization.output_result_cls = StepLoss
        self._engine: Engine | None = None
        self._records: list[TaskRecord] = []  # of the engine steps since the last batch ended
        self._batches: EpochBatches | None = None
        self._saved_batch_sizes: list[int | None] | None = None  # of the checkpoint this run resumes
        self._saved_world_size: int | None = None  # of the checkpoint this run resumes
        self._profiling = False  # Lightning's "run_training_batch" profiler section is open
        self._takes_batch_idx: tuple[Any, bool] | None = None  # (training_step's function, takes batch_idx)
        self._length_of: Any = None  # the train loaders whose length on this rank is _own_length
        self._own_length: int | float = float("inf")

    # ----- the epoch -------------------------------------------------------------------------------

    @override
    def run(self, data_fetcher: _DataFetcher) -> None:
        self._batches = None  # an epoch that an exception ended left its batches for a checkpoint; not this one's
        # started first: the ranks' agreement below waits for the others, and the step timeout watches it there
        # (a rank that failed before the first epoch ends the others with its error, not the groups' timeout)
        engine = self._start_engine()
        self._agree_epoch_length()
        at_epoch_end = self.restarting and self.restarted_on_train_batch_end  # saved at a batch end: maybe the last
        self.reset()
        self.on_run_start(data_fetcher)
        if at_epoch_end and self.batch_progress.current.ready == 0:  # Lightning's reset began the next epoch
            new_pass(data_fetcher)
        if self._resume_validation(data_fetcher) or self.done:
            return
        if isinstance(data_fetcher, _DataLoaderIterDataFetcher):
            raise RuntimeError(
                "HSTUPipelineStrategy feeds batches to training_step(batch, batch_idx); "
                "a training_step that takes a dataloader_iter is not supported"
            )
        start = self.batch_progress.current.ready  # batches of this epoch trained before a resume
        self._batches = EpochBatches(
            data_fetcher,
            start=start,
            stop=self.trainer.num_training_batches,
            keep_states=self._strategy.plan.depth + 3,
            ask_all_ranks_have=self._strategy.ask_all_ranks_have_batch,
        )
        if start:
            self._check_resume(start)
        if start and not self._batches.stateful:
            # on_run_start already counted them (as for a stateful loader); uncount them before skipping,
            # or the fetcher would count them twice and declare the epoch over early
            data_fetcher.fetched -= start
            self._batches.skip(start)
        try:
            # the per-batch hooks that nothing overrides are not called while the steps run
            with (
                skipping_idle_hooks(self.trainer),
                contextlib.closing(
                    engine.steps(self._batches, self._before_step, start=start, source=self._batches.describe())
                ) as steps,
            ):
                for result in steps:
                    self._records.extend(result.records)
                    if result.batch is None:
                        continue  # the fill: no batch reached lookahead 0 yet
                    # Lightning's hooks may wait for the device (a logged loss's .item()) or launch a
                    # collective: a rank that hangs there is reported like a hung step.
                    with engine.watched(f"the end of batch {result.batch} (on_train_batch_end hooks, logging)"):
                        self._finish_batch(result)
                    self._pin_threads(engine)
                    try:
                        self.on_advance_end(data_fetcher)
                    finally:
                        self.on_iteration_done()
                    if self.done:
                        break
        except BaseException as error:
            self._strategy.sigterm.forget()
            # before Lightning's on_exception hooks, which may themselves wait for the other ranks (a checkpoint)
            self._strategy.note_failure(error)
            # steps() has joined the engine's threads: a batch whose optimizer step they applied before the
            # exception (a Ctrl-C while the step ran on another thread, a failure later in the same step) is
            # trained, and a checkpoint saved on the exception must count it so
            self._count_applied_step()
            raise
        finally:
            self._strategy.release_threads()  # the next epoch's loader iterator starts with the cores
            self._tasks.current = None
            if self._profiling:  # a step that failed
                self._profiling = False
                self.trainer.profiler.stop("run_training_batch")
        self._settle_sigterm(engine)
        # The epoch ended. After an exception the batches stay: Lightning saves a checkpoint on it after this
        # loop ends (OnExceptionCheckpoint, a SIGTERM's save), which takes the loader state from before the
        # oldest batch not trained from them.
        self._batches = None

    def _agree_epoch_length(self) -> None:
        """On several ranks whose loaders have lengths, every rank's epoch is the shortest rank's: the ranks
        end the epoch at the same batch anyway (``EpochBatches``), and Lightning places its validation by the
        epoch's length (``val_check_interval`` as a fraction, and at the epoch's last batch), so ranks that
        kept their own lengths validated at different batches and waited for each other in different
        collectives. The rank whose batches go untrained warns."""
        trainer = self.trainer
        loader = trainer.fit_loop._combined_loader
        if loader is not self._length_of:  # set up anew (the first epoch, a reload): its length is this rank's
            self._length_of, self._own_length = loader, trainer.num_training_batches
        own = self._own_length
        least = self._strategy.least_over_ranks(own)
        if least >= own:
            return
        least = int(least)  # a length: only the loaders without one have inf
        trainer.fit_loop.max_batches = least
        interval = trainer.val_check_interval
        if isinstance(interval, float) and trainer.val_check_batch not in (None, float("inf")):
            trainer.val_check_batch = max(1, int(least * interval))  # as Lightning's _FitLoop.setup_data
        mine = "no length" if own == float("inf") else f"{own}"
        warnings.warn(
            f"rank {trainer.global_rank}: another rank has {least} training batches this epoch, this rank "
            f"{mine}; every rank ends the epoch at batch {least}, so the rest of this rank's batches are not "
            "trained this epoch",
            stacklevel=2,
        )

    def _count_applied_step(self) -> None:
        """What Lightning does between a batch's optimizer step and its ``on_train_batch_end`` hooks, for the
        current batch when an exception ended the epoch after the engine had applied its step."""
        current, progress = self._tasks.current, self.batch_progress.current
        if current is None or not current.stepped or progress.processed >= progress.ready:
            return
        self._processed()

    def _processed(self) -> None:
        """Lightning's count of a processed batch and its LR schedulers' steps (epoch-interval ones at the
        epoch's last batch)."""
        self.batch_progress.increment_processed()
        self.update_lr_schedulers("step", update_plateau_schedulers=False)
        if self._num_ready_batches_reached():
            self.update_lr_schedulers("epoch", update_plateau_schedulers=False)

    def _pin_threads(self, engine: Engine) -> None:
        """With ``pin_threads``: the caller's and the engine's threads on their core, from the end of the epoch's
        first batch (after its compilations and the like) or of the first batch after a validation."""
        pin = self._strategy.thread_pin
        if pin is not None and not pin.pinned:
            pin.pin([threading.current_thread(), *engine.threads()])

    def _check_resume(self, start: int) -> None:
        """A mid-epoch resume skips the batches the checkpoint had trained, counted in batches of each rank's
        share: with another batch size, or another number of ranks (other shares), that would skip other
        samples than those trained."""
        saved, current = self._saved_batch_sizes, self._batches.batch_sizes()
        saved_ranks, ranks = self._saved_world_size, self.trainer.world_size
        self._saved_batch_sizes = self._saved_world_size = None  # only the epoch the checkpoint was saved in
        if saved is None and saved_ranks is None:
            warnings.warn(
                f"the checkpoint was saved {start} batches into an epoch by a loop that did not record its batch "
                f"size and number of ranks (not HSTUPipelineStrategy's): resuming skips {start} batches of this "
                f"run's batch size {_sizes(current)} per rank on {ranks} rank(s); if either differs from the run "
                "that saved it, other samples are skipped than those it trained",
                stacklevel=2,
            )
            return
        if saved_ranks is not None and saved_ranks != ranks:
            raise CheckpointError(
                f"the checkpoint was saved {start} batches into an epoch on {saved_ranks} rank(s); this run has "
                f"{ranks}: each rank's share of the epoch differs, so skipping {start} batches per rank would "
                f"train some samples twice or never. Resume on {saved_ranks} rank(s) (the number of ranks can "
                f"change at an epoch boundary)"
            )
        if saved is None or saved == current:
            return
        raise CheckpointError(
            f"the checkpoint was saved {start} batches into an epoch, with train dataloader batch size "
            f"{_sizes(saved)}; this run's train dataloader has batch size {_sizes(current)}: resuming there would "
            f"skip other samples than the {start} batches trained. Resume with batch size {_sizes(saved)} (it "
            f"can change at an epoch boundary)"
        )

    def _resume_validation(self, data_fetcher: _DataFetcher) -> bool:
        """What Lightning's ``advance`` does first when restarting from a checkpoint saved around validation."""
        resumed_here = False
        if self.restarting and self._should_check_val_fx(data_fetcher):
            if self.val_loop.restarted_mid_evaluation or self.restarted_on_last:
                # finish the interrupted validation, or skip the one already done, as Lightning's advance does:
                # an interrupted one is finished even when the checkpoint was also taken at the epoch's last batch
                self._skip_next_val = self.restarted_on_last and not self.val_loop.restarted_mid_evaluation
                try:
                    self.on_advance_end(data_fetcher)
                finally:
                    self.on_iteration_done()
                resumed_here = self.done
            else:
                self.val_loop.increment_progress_to_evaluation_end()
        self.val_loop.restarting = False
        return resumed_here

    def _start_engine(self) -> Engine:
        if self._engine is None:
            device = self.trainer.strategy.root_device
            plan, module = self._strategy.plan, self.trainer.lightning_module
            graphs = module.hstu_graphs() if plan.capturable else None
            self._engine = Engine(
                plan,
                self._tasks.bodies(plan),
                device=device if device.type == "cuda" else None,
                step_timeout=self._strategy.step_timeout,
                on_timeout=self._strategy.timeout_actions(),
                observers=self._strategy.engine_observers,
                graphs=graphs,
            ).start()
        return self._engine

    @property
    def engine(self) -> Engine | None:
        """The engine (None before the first epoch starts it and after it is closed)."""
        return self._engine

    # ----- around each step ------------------------------------------------------------------------

    def _before_step(self, step: int) -> bool:
        """Announce batch ``step`` to Lightning before its lookahead-0 tasks run; False ends the epoch."""
        if step < self._batches.start:
            return True  # the fill
        trainer = self.trainer
        if self._strategy.sigterm.agreed:
            self._broadcast_sigterm_tensor()
        batch = self._engine.slots(step)["shuffled_batch"]
        batch_idx = step  # == self.batch_idx + 1: the engine numbers batches as the epoch does
        self.batch_progress.is_last_batch = self._is_last(step)
        self.batch_progress.increment_ready()
        trainer._logger_connector.on_batch_start(batch)
        if batch is None:
            _warnings.warn("train_dataloader yielded None. If this was on purpose, ignore this warning...")
            self._tasks.current = TrainBatch(batch_idx, OrderedDict(), False, self._context(step), skip=True)
            return True
        call._call_callback_hooks(trainer, "on_train_batch_start", batch, batch_idx)
        response = call._call_lightning_module_hook(trainer, "on_train_batch_start", batch, batch_idx)
        call._call_strategy_hook(trainer, "on_train_batch_start", batch, batch_idx)
        if response == -1:  # the module asks to skip the rest of the epoch
            self.batch_progress.increment_by(0, is_last_batch=True)
            self._processed()  # the last batch: the epoch-interval schedulers step too
            return False
        self.batch_progress.increment_started()
        kwargs = self._build_kwargs(OrderedDict(), batch, batch_idx)
        self._tasks.current = TrainBatch(batch_idx, kwargs, self._should_accumulate(), self._context(step))
        trainer.profiler.start("run_training_batch")  # Lightning's section: this batch's lookahead-0 tasks
        self._profiling = True
        return True

    def _settle_sigterm(self, engine: Engine) -> None:
        """At the end of an epoch on several ranks: the last batch's SIGTERM check answered and the ranks asked
        once more (``SigtermNotice.settle``), so that no check stays open past the epoch. A failed check does
        not stop training, as Lightning's per-batch check."""
        if not self._strategy.sigterm.agreed:
            return
        with engine.watched("the ranks' SIGTERM check at the end of the epoch"), contextlib.suppress(Exception):
            self._strategy.sigterm.settle(self._strategy.ask_any_rank)

    @override
    def _broadcast_sigterm_tensor(self) -> None:
        """Lightning's per-batch SIGTERM check, decided by every rank together: all ranks stop here when any
        rank had received SIGTERM at the check before (``strategies/sigterm.py``: each check's answer is read at
        the next, so that no rank waits here for the others). Lightning broadcasts rank 0's flag as a tensor on
        the device over the default group and reads it back with ``.item()``, which on a GPU waits for every
        collective queued before it on that group's NCCL stream (the steps' all-to-alls and all-reduces)
        before the next step can be queued; this runs on the strategy's gloo agreement group."""
        try:
            stop = self._strategy.sigterm.stop(self._strategy.ask_any_rank)
        except Exception:  # as Lightning: a failed check does not stop training
            stop = False
        if stop:
            with contextlib.suppress(Exception):
                torch.distributed.barrier()  # as Lightning: every rank leaves together
            raise SIGTERMException()

    def _finish_batch(self, result: StepResult) -> None:
        """Lightning's end of a batch, after the step that trained it."""
        trainer = self.trainer
        if self._profiling:
            self._profiling = False
            trainer.profiler.stop("run_training_batch")
        current = self._tasks.current
        closure = current.result
        outputs = {} if closure is None or closure.loss is None else closure.asdict()
        self._processed()
        batch = current.kwargs.get("batch")
        if current.skip:  # the loader gave None: Lightning calls the hooks with no outputs and no batch too
            outputs = None
        call._call_callback_hooks(trainer, "on_train_batch_end", outputs, batch, current.batch_idx)
        call._call_lightning_module_hook(trainer, "on_train_batch_end", outputs, batch, current.batch_idx)
        trainer._logger_connector.on_batch_end()
        self.batch_progress.increment_completed()
        trainer._logger_connector.update_train_step_metrics()
        if _wrote_step_metrics(trainer):
            _retire_step_values(trainer)
        self._records = []

    @override
    def _build_kwargs(self, kwargs: OrderedDict, batch: Any, batch_idx: int) -> OrderedDict:
        """Lightning's, with its check whether ``training_step`` takes ``batch_idx`` (``inspect`` on every
        batch, on the caller's thread between two steps) made once per ``training_step`` function."""
        training_step = self.trainer.lightning_module.training_step
        function = getattr(training_step, "__func__", training_step)
        if self._takes_batch_idx is None or self._takes_batch_idx[0] is not function:
            self._takes_batch_idx = (function, is_param_in_hook_signature(training_step, "batch_idx", min_args=2))
        kwargs["batch"] = batch
        if self._takes_batch_idx[1]:
            kwargs["batch_idx"] = batch_idx
        return kwargs

    def _context(self, step: int) -> StepContext:
        engine = self._engine
        return StepContext(step, engine.slots(step), engine, self._strategy.all_ranks)

    def _is_last(self, step: int) -> bool:
        # The ring has pulled ahead, so the end of data is usually known already (always with depth >= 2).
        if self._batches.count is not None:
            return step == self._batches.start + self._batches.count - 1
        return step + 1 >= self.trainer.num_training_batches

    # ----- checkpoints and teardown ----------------------------------------------------------------

    @property
    def step_context(self) -> StepContext | None:
        """The step training the current batch (None outside a batch)."""
        current = self._tasks.current
        return None if current is None else current.context

    def step_records(self) -> tuple[TaskRecord, ...]:
        """The task records of the engine steps since the previous batch ended (the fill's steps included)."""
        return tuple(self._records)

    @override
    def on_save_checkpoint(self) -> dict:
        state = super().on_save_checkpoint()
        if self._batches is not None:  # mid-epoch: a resume skips what was trained, counted in batches
            record_shares(state, self._batches.batch_sizes(), self.trainer.world_size)
        return state

    @override
    def on_load_checkpoint(self, state_dict: dict) -> None:
        super().on_load_checkpoint(state_dict)
        self._saved_batch_sizes = state_dict.get(BATCH_SIZES_KEY)
        self._saved_world_size = state_dict.get(WORLD_SIZE_KEY)

    def loader_state_to_save(self) -> list[dict[str, Any]] | None:
        """During an epoch, or after an exception ended it: the loader state from before the oldest batch not
        yet trained."""
        if self._batches is None or not self._batches.stateful:
            return None
        return self._batches.loader_state(self.batch_progress.current.processed)

    def close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    @override
    def teardown(self) -> None:
        self.close_engine()
        super().teardown()


class EngineFitLoop(_FitLoop):
    """Lightning's fit loop; only what a checkpoint saves of the dataloader changes."""

    epoch_loop: EngineEpochLoop

    @override
    def on_save_checkpoint(self) -> dict:
        loader_state = self.epoch_loop.loader_state_to_save()
        if loader_state is None:
            return super().on_save_checkpoint()
        # during an epoch the loader thread may be pulling the next batch: its live state is not read here
        state = _Loop.on_save_checkpoint(self)
        state["combined_loader"] = loader_state
        return state


def install_engine_loop(trainer, strategy: "HSTUPipelineStrategy") -> EngineEpochLoop:
    """Replace the trainer's fit loop by one whose epoch loop is the engine, keeping its settings; return
    that epoch loop. A later ``fit`` of the same Trainer keeps it, as Lightning keeps its own: the epochs,
    batches and optimizer steps already trained stay counted (a new loop would train from epoch 0 again)."""
    old = trainer.fit_loop
    if isinstance(old, EngineFitLoop):
        return old.epoch_loop
    loop = EngineFitLoop(trainer, min_epochs=old.min_epochs, max_epochs=old.max_epochs)
    loop._data_source = old._data_source
    epoch_loop = EngineEpochLoop(trainer, old.epoch_loop.min_steps, old.epoch_loop.max_steps, strategy)
    epoch_loop.val_loop = old.epoch_loop.val_loop
    loop.epoch_loop = epoch_loop
    trainer.fit_loop = loop
    return epoch_loop


def _sizes(sizes: list[int | None]) -> str:
    return ", ".join(str(size) for size in sizes)


def _wrote_step_metrics(trainer) -> bool:
    """Whether ``_LoggerConnector.update_train_step_metrics`` just gave the step's values to the loggers (its
    conditions: not inside an accumulation window under automatic optimization; a logging step)."""
    connector = trainer._logger_connector
    if trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization:
        return False
    return bool(connector.should_update_logs or trainer.fast_dev_run)


def _retire_step_values(trainer) -> None:
    """Takes the values logged for steps only (``on_step=True, on_epoch=False``) out of Lightning's results
    once the loggers have them. Lightning keeps the last one of each and, at every later batch end, turns
    those shown in the progress bar into numbers again (``convert_tensors_to_scalars``): a copy to the host
    that waits for the whole queue of the current CUDA stream, each step, for a value logged every
    ``log_every_n_steps``. The progress bar, ``callback_metrics`` and ``logged_metrics`` keep the last values
    (Lightning updates them, never clears them); the next ``self.log`` of a key brings it back."""
    results = trainer._results
    if results is None:
        return
    for _, metric in results.valid_items():
        if metric.meta.on_step and not metric.meta.on_epoch:
            metric.has_reset = True


__all__ = ["EngineEpochLoop", "EngineFitLoop", "install_engine_loop"]
