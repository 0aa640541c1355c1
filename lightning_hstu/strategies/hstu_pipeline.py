"""HSTUPipelineStrategy: Lightning's DDP strategy whose training epoch loop is the engine."""

import contextlib
import difflib
import inspect
import os
import pickle
import threading
import uuid
import zipfile
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from typing_extensions import override

from ..engine import PeerFailure, TaskObserver, TaskRecord, TimeoutActions, check_step_timeout
from ..engine.affinity import ThreadPin, check_pin_threads, core_for
from ..engine.watchdog import call_bounded
from ..hstu.presets import DEFAULT_PRESET, PRESET_NAMES, resolve_plan
from ..hstu.sparse import TABLES_AHEAD
from ..hstu.tasks import GRAPH_TASKS
from ..loops.epoch_batches import BATCH_SIZES_KEY, batch_sizes, record_shares
from ..loops.errors import CheckpointError
from ..plan import PlanError
from . import process_groups, sharded_checkpoint, sigterm


def unknown_strategy_error(name: str) -> PlanError:
    return PlanError(
        f"unknown strategy {name!r}; the HSTU strategies are: {', '.join('hstu_' + preset for preset in PRESET_NAMES)}"
    )


NOTED_FAILURE_CHARS = 4000
"""At most this much of a failure's message is left for the other ranks (a TaskError quotes its cause)."""


class _NamesWithHSTUPrefix(list):
    """Registered strategy names that also "contain" every ``hstu_<name>``, so that Lightning's name check
    lets an unknown one through to the registry's ``get``, which says what is valid."""

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or (isinstance(name, str) and name.startswith("hstu_"))


class _RegistryNamingHSTUPresets(_StrategyRegistry):
    """Lightning's strategy registry, except that an unknown ``hstu_<name>`` raises ``PlanError`` listing
    the nine presets. Lightning (2.6) checks a strategy name against ``available_strategies()`` in
    ``Trainer(...)`` and raises a generic error that lists no preset; every other name behaves as before."""

    @override
    def available_strategies(self) -> list:
        return _NamesWithHSTUPrefix(super().available_strategies())

    @override
    def get(self, name: str, default: Any = None) -> Any:
        if isinstance(name, str) and name.startswith("hstu_") and name not in self.keys():
            raise unknown_strategy_error(name)
        return super().get(name, default)


class HSTUPipelineStrategy(DDPStrategy):
    """Trains with the lookahead-ring threaded engine under one of the nine presets (or a custom plan).

    Args:
        preset: one of ``lightning_hstu.PRESET_NAMES`` (``lightning_hstu.hstu.presets.PRESET_NOTES``, or
            ``lightning-hstu presets -v``, says where each was measured to win and lose).
        thread_map: replaces the preset's thread map: a thread-map name, ``"none"`` (every task on the
            caller's thread) or ``{task: thread}``.
        lookahead: replaces the preset's cascade: ``"d3"``, ``"d6"`` or ``{task: lookahead}``.
        prefetch: order each step's embedding prefetch before its backward.
        capture_graphs: mark forward, backward and optimizer_step capturable: on a GPU the engine captures
            the module's graphs (``hstu_graphs()``: for HSTU the dense part on inputs of static shapes,
            padded to a fixed length or jagged with a token capacity, and the dense AdamW's step) after a
            few warm-up steps and replays them.
        engine: False trains with Lightning's own loop instead (everything else unchanged: the process
            groups, no torch DDP around a module that finalises its own gradients, sharded checkpoints):
            the unpipelined baseline of the same module, for comparisons.
        step_timeout: seconds after which a step that has not finished, a batch the train dataloader has
            not given, or Lightning's hooks around a step that have not returned, are reported (with what
            every thread was doing and the collectives in flight) and training stops; None waits forever.
            Under every preset, ``legacy_none`` included. On more than one process, the rank that times out
            aborts its process groups and ends (docs/watchdog.md). It also sets the process groups' own
            timeout to ``2 * step_timeout + 60`` s, unless ``timeout=`` is given.
        pin_threads: a CPU core (or a list, one per process of a machine: local rank ``i`` takes the ``i``-th)
            on which the caller's thread and the engine's threads run during training, from the end of each
            epoch's first batch to the end of the epoch; validation runs with the cores they had (Linux only;
            None leaves threads where the operating system puts them). Their Python hands the GIL over
            within one core's caches (measured in BENCHMARKS.md, "The step's threads on one core"). For GPU
            training: on a CPU device the step's compute runs on these threads too.
        timeout: the process groups' timeout (Lightning's ``DDPStrategy``'s); None: as ``step_timeout`` says,
            Lightning's default without one. A parameter here, not one of ``**ddp_kwargs``, so that its default
            is None in a LightningCLI config too, which passes every default of a ``class_path`` strategy
            (``DDPStrategy``'s: 30 min).
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (its own arguments, and torch
            ``DistributedDataParallel``'s, which it passes on); any other name raises ``TypeError``.

    A bad preset, thread map, lookahead, step_timeout or pin_threads, or capture_graphs or pin_threads without
    the engine, raises ``PlanError`` (a ``ValueError``) here, i.e. at ``Trainer(...)``; so does an unknown
    ``strategy="hstu_<name>"``.
    """

    strategy_name = "hstu_pipeline"

    def __init__(
        self,
        preset: str = DEFAULT_PRESET,
        *,
        thread_map: Mapping[str, str] | str | None = None,
        lookahead: Mapping[str, int] | str | None = None,
        prefetch: bool = True,
        capture_graphs: bool = False,
        step_timeout: float | None = 600.0,
        engine: bool = True,
        pin_threads: int | list[int] | None = None,
        timeout: timedelta | None = None,
        **ddp_kwargs: Any,
    ):
        _check_ddp_kwargs(ddp_kwargs)
        step_timeout = check_step_timeout(step_timeout)
        self.pin_threads = check_pin_threads(pin_threads)
        if self.pin_threads is not None and not engine:
            raise PlanError("pin_threads needs engine=True: it places the engine's threads and the caller's")
        if timeout is None and step_timeout is not None:
            timeout = process_groups.process_group_timeout(step_timeout)
        if timeout is not None:
            ddp_kwargs["timeout"] = timeout
        super().__init__(**ddp_kwargs)
        if capture_graphs and not engine:
            raise PlanError("capture_graphs=True needs engine=True: the engine captures the graphs between steps")
        self.use_engine = engine
        self.plan = resolve_plan(
            preset,
            cascade=lookahead,
            thread_map=thread_map,
            prefetch=prefetch,
            capturable=GRAPH_TASKS if capture_graphs else (),
        )
        if self.plan.task("finish_shuffle").lookahead < 1:
            raise PlanError(
                "HSTUPipelineStrategy needs finish_shuffle at lookahead >= 1: Lightning's "
                "on_train_batch_start hooks receive the training batch before its step runs"
            )
        self.preset = preset
        self.step_timeout = step_timeout
        self.engine_observers: list[TaskObserver] = []
        """Called around every task on its thread; callbacks add theirs in ``setup`` (NVTXCallback)."""
        self._epoch_loop: Any = None  # the engine's epoch loop, which owns the engine (while fitting)
        self._data_group: Any = None
        self._loader_group: Any = None
        self._failed = False  # the stage ended by an exception: its groups are left as they are
        self._failure_key: str | None = None
        """Where this stage's first failing rank leaves its failure for the others (several ranks only)."""
        self.thread_pin: ThreadPin | None = None
        """While fitting with ``pin_threads``: what places the threads (the engine's epoch loop pins them)."""
        self.sigterm: sigterm.SigtermNotice | None = None
        """The trainer's SIGTERM handler from ``setup`` on (``strategies/sigterm.py``)."""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for preset in PRESET_NAMES:
            strategy_registry.register(
                f"hstu_{preset}", cls, description=f"HSTU engine, preset {preset}", preset=preset
            )
        if type(strategy_registry) is _StrategyRegistry:
            strategy_registry.__class__ = _RegistryNamingHSTUPresets

    @override
    def setup(self, trainer) -> None:
        _keep_shards_local(trainer.lightning_module)
        super().setup(trainer)
        engine_fit = trainer.state.fn == TrainerFn.FITTING and self.use_engine
        self.sigterm = sigterm.install(trainer, agreed=engine_fit and self.world_size > 1)
        if not engine_fit:
            return
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise MisconfigurationException(
                "HSTUPipelineStrategy supports automatic optimization only: the engine runs zero_grad, "
                "training_step, backward and optimizer_step as separate tasks, which manual optimization "
                "does inside training_step. Use strategy='ddp' for this module."
            )
        if len(trainer.optimizers) != 1 or isinstance(trainer.optimizers[0], torch.optim.LBFGS):
            raise MisconfigurationException(
                "HSTUPipelineStrategy needs exactly one optimizer that evaluates its closure once "
                f"(got {[type(o).__name__ for o in trainer.optimizers]})"
            )
        if self.plan.capturable and not callable(getattr(module, "hstu_graphs", None)):
            raise MisconfigurationException(
                f"capture_graphs=True, but {type(module).__name__} defines no hstu_graphs() saying what to capture "
                f"(HSTURecommender does); use capture_graphs=False for this module"
            )
        from ..loops import install_engine_loop

        if self.pin_threads is not None:
            self.thread_pin = ThreadPin(core_for(self.pin_threads, self.local_rank, self.num_processes))
        self._epoch_loop = install_engine_loop(trainer, self)

    @override
    def configure_ddp(self) -> None:
        if callable(getattr(self.lightning_module, "hstu_finalize_model_grads", None)):
            # The module reduces its dense gradients itself (finalize_model_grads) and TorchRec shards its
            # embeddings: torch DDP around it would reduce them twice, inside backward.
            return
        if self.world_size == 1:
            # One process has no gradient to average: torch DDP would only add its reducer's bucketing and
            # a one-rank all-reduce to every backward (about 0.3 ms per step of host time on a small module,
            # benchmarks/strategy_overhead.py).
            return
        super().configure_ddp()

    @property
    def step_context(self) -> Any:
        """The step training the current batch (``lightning_hstu.loops.StepContext``: its slots, such as
        ``embeddings`` and ``global_tokens``, the task streams, the ranks' agreement), read during the batch
        by ``training_step``; None outside a training batch and under Lightning's own loop (``engine=False``)."""
        return None if self._epoch_loop is None else self._epoch_loop.step_context

    @property
    def step_records(self) -> tuple[TaskRecord, ...]:
        """Task records of the engine steps since the previous batch ended: what callbacks read in
        ``on_train_batch_end``."""
        return () if self._epoch_loop is None else self._epoch_loop.step_records()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The module's (or its data module's) three transfer hooks, ``on_before_batch_transfer``,
        ``transfer_batch_to_device`` and ``on_after_batch_transfer``, as Lightning's strategies run them, but
        called directly: the engine's h2d task calls this on its own thread while ``training_step`` may be
        logging on another, and Lightning's hook caller would rename the hook being run under it. Override
        it (calling ``super()``) to change how every training and evaluation batch reaches the device."""
        module = self.lightning_module
        device = device or self.root_device
        if module is None or module._trainer is None:
            return super().batch_to_device(batch, device, dataloader_idx)
        selector = module.trainer._data_connector._datahook_selector
        for hook in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"):
            run = getattr(selector.get_instance(hook), hook)
            batch = (
                run(batch, device, dataloader_idx) if hook == "transfer_batch_to_device" else run(batch, dataloader_idx)
            )
        return batch

    def task_stream(self, task: str) -> Any:
        """The CUDA stream the engine runs ``task`` on (None on CPU or before the engine started): for a task
        that hands work to another, as the embedding prefetch tells fbgemm where the lookup will run."""
        engine = self._engine
        return engine.stream(self.plan.task(task).stream) if engine is not None else None

    @property
    def _engine(self) -> Any:
        return None if self._epoch_loop is None else self._epoch_loop.engine

    @property
    def process_group_timeout(self) -> timedelta:
        """The timeout of the process groups' collectives (``timeout=``, else from ``step_timeout``)."""
        return self._timeout

    @override
    def setup_environment(self) -> None:
        _check_default_group(self.root_device)
        if self.step_timeout is not None:
            process_groups.enable_flight_recorder()  # before the first process group exists
        super().setup_environment()
        self._failed = False
        self._failure_key = None
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            # for all_ranks() and ask_any_rank(), and for ask_all_ranks_have_batch()
            self._data_group = dist.new_group(
                backend="gloo", timeout=self._timeout, group_desc=process_groups.AGREEMENT_GROUP
            )
            self._loader_group = dist.new_group(
                backend="gloo", timeout=self._timeout, group_desc=process_groups.LOADER_GROUP
            )
            if self.use_engine and self.step_timeout is not None:  # the engine's watchdog reads it
                # one key per stage, rank 0's (the store outlives the stage: an earlier stage's must not be read)
                key = [f"lightning_hstu/failure/{uuid.uuid4().hex}"]
                dist.broadcast_object_list(key, src=0, group=self._data_group)
                self._failure_key = key[0]

    def timeout_actions(self) -> TimeoutActions:
        """What the engine's watchdog does on a timeout besides the report. On several processes: name the
        rank, list the collectives in flight, abort the process groups and end the process (a launching
        rank first ends the ranks it launched), so that no rank waits for the process groups' timeout."""
        if not (dist.is_available() and dist.is_initialized() and self.world_size > 1):
            return TimeoutActions()
        grace = TimeoutActions.grace
        launched = getattr(self.launcher, "procs", None) or []  # Lightning's subprocess launcher, on rank 0
        return TimeoutActions(
            rank=self.global_rank,
            collectives_in_flight=process_groups.collectives_in_flight,
            abort=process_groups.abort_process_groups,
            end_process=True,
            grace=grace,
            before_exit=lambda: process_groups.end_launched_ranks(launched, grace),
            peer_failure=self._peer_failure,
        )

    def _peer_failure(self) -> str | None:
        key = self._failure_key
        return None if key is None else process_groups.noted_failure(key, self.global_rank)

    def note_failure(self, error: BaseException) -> None:
        """Tell the other ranks that this rank's stage failed with ``error``: their watchdogs end the steps that
        wait in a collective for this rank (``PeerFailure``, within about a second) instead of letting them
        wait until the step timeout. Once per stage, on several ranks, with a step timeout; not for a stop
        that every rank makes together (SIGTERM), an interrupt, or another rank's failure."""
        key, self._failure_key = self._failure_key, None
        if key is None or self.step_timeout is None or not isinstance(error, Exception):
            return
        if isinstance(error, (PeerFailure, SIGTERMException)):
            return
        text = f"rank {self.global_rank} failed: {type(error).__name__}: {error}"
        if len(text) > NOTED_FAILURE_CHARS:
            text = text[:NOTED_FAILURE_CHARS] + " ..."
        noted = call_bounded(
            lambda: process_groups.note_failure(key, self.global_rank, text), "telling the other ranks of the failure"
        )
        if noted:  # until the others read it (or failed too): the store may go with this process
            wait = process_groups.FAILURE_LINGER_S
            call_bounded(
                lambda: process_groups.wait_until_read(key, self.world_size - 1, wait),
                "waiting for the other ranks to read the failure",
                wait + 0.5,
            )

    def all_ranks(self, flag: bool) -> bool:
        """Whether ``flag`` is True on every rank (this rank's flag on a single process): "every rank's loss
        is finite". Runs on a gloo group of its own, so it never interleaves with the collectives the tasks
        launch on the default group."""
        return _all_ranks_on(self._data_group, flag)

    def ask_all_ranks_have_batch(self, flag: bool) -> Callable[[], bool]:
        """Starts ``all_ranks`` for "every rank has a next batch" without waiting, on a second gloo group (the
        engine's loader thread asks it while the step's tasks and the caller may use the first), and returns
        the function that waits for the answer."""
        return _ask_all_ranks_on(self._loader_group, flag)

    def least_over_ranks(self, value: float) -> float:
        """The smallest of the ranks' ``value`` (``inf`` allowed: a loader without a length), on every rank;
        this rank's on a single process. Between epochs, on the same gloo group as ``all_ranks``."""
        if self._data_group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        with self._caller_watched("agreeing on the epoch's number of batches with the other ranks"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._data_group)
        return tensor.item()

    def ask_any_rank(self, flag: bool) -> Callable[[], bool]:
        """Starts "is ``flag`` True on any rank" (a rank received SIGTERM) without waiting, and returns the
        function that waits for the answer (this rank's flag on a single process). On the same gloo group as
        ``all_ranks``: every rank asks in the same order of that group's collectives (between two steps)."""
        nobody = _ask_all_ranks_on(self._data_group, not flag)
        return lambda: not nobody()

    # ----- checkpoints: a directory through torch.distributed.checkpoint when tables are sharded ----------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        _record_mid_epoch_shares(getattr(self.lightning_module, "_trainer", None), checkpoint)
        with self._step_timeout_paused():  # writing a checkpoint may rightly take longer than a step
            if not sharded_checkpoint.holds_sharded(checkpoint):
                local = self._local_file(filepath, storage_options)
                if local is None:
                    return super().save_checkpoint(checkpoint, filepath, storage_options)
                sharded_checkpoint.save_file(checkpoint, local, self.is_global_zero, self.broadcast)
                return None
            if storage_options is not None:
                raise TypeError(f"storage_options are not supported for sharded checkpoints (got {storage_options!r})")
            # one id, and one staging directory, for all ranks
            save_id = self.broadcast(sharded_checkpoint.new_save_id())
            sharded_checkpoint.save(checkpoint, filepath, save_id, self.is_global_zero, self.broadcast)

    def _local_file(self, filepath: Any, storage_options: Any) -> str | None:
        """The local file that Lightning's default checkpoint I/O would write a checkpoint without sharded
        tensors to (``sharded_checkpoint.save_file`` writes it atomically instead); None for any other
        checkpoint I/O, a remote path or ``storage_options``, which are left to Lightning."""
        if storage_options is not None or type(self.checkpoint_io) is not TorchCheckpointIO:
            return None
        return _local_path(filepath)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._step_timeout_paused():  # Lightning's barriers wait for the slowest rank's checkpoint write
            super().barrier(*args, **kwargs)

    def _step_timeout_paused(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._engine is None else self._engine.paused()

    def _caller_watched(self, what: str) -> contextlib.AbstractContextManager:
        """The step timeout around the caller's own work while a fit's engine runs (a no-op on the engine's
        threads, whose work the step's own watch times, and without an engine or a timeout): a collective
        there that waits for a rank that failed or hangs is reported and ends the process, as a hung step's
        caller is, where it would otherwise wait for the process group's timeout."""
        engine = self._engine
        if engine is None or threading.current_thread() in engine.threads():
            return contextlib.nullcontext()
        return engine.watched(what)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, under the step timeout inside a training epoch (``_caller_watched``): its collectives
        (TorchRec's input distribution) wait for the other ranks."""
        with self._caller_watched(f"validation_step of batch {args[1]}" if len(args) > 1 else "validation_step"):
            return super().validation_step(*args, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's, under the step timeout inside a training epoch (``_caller_watched``): the metrics
        logged with ``sync_dist`` are reduced here, at a validation's end among others."""
        with self._caller_watched(f"reducing a tensor over the ranks (reduce_op {reduce_op!r})"):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """Lightning's, under the step timeout inside a training epoch (``_caller_watched``)."""
        with self._caller_watched("gathering a tensor from the ranks"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if not sharded_checkpoint.is_sharded_checkpoint(checkpoint_path):
            sharded_checkpoint.check_not_partial(checkpoint_path)
            try:
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            except pickle.UnpicklingError as error:
                if not _is_local_non_zip(checkpoint_path):
                    raise  # what weights_only refused in a checkpoint torch.save wrote (a zip archive)
                # not torch.save's archive at all (overwritten, a git-lfs pointer): torch's refusal would advise
                # weights_only=False, which runs the file as code and fails too
                reason = "not the zip archive that torch.save writes"
                raise sharded_checkpoint.unreadable(checkpoint_path, error, reason) from error
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                raise  # Lightning's and torch's messages name the file
            except (OSError, EOFError, RuntimeError) as error:  # a file cut short or damaged
                raise sharded_checkpoint.unreadable(checkpoint_path, error) from error
        trainer = self.lightning_module.trainer
        connector = trainer._checkpoint_connector

        def check(checkpoint: dict[str, Any]) -> None:
            mismatch = getattr(self.lightning_module, "checkpoint_mismatch", None)
            differ = [] if mismatch is None else mismatch(checkpoint.get("hyper_parameters") or {})
            if differ:
                raise CheckpointError(
                    f"checkpoint {checkpoint_path} was saved by a model of another configuration: {'; '.join(differ)}. "
                    "Load it into a model with the checkpoint's settings"
                )
            ahead = checkpoint.get(TABLES_AHEAD)
            if ahead is not None and trainer.state.fn == TrainerFn.FITTING:
                epoch, batch = ahead
                raise CheckpointError(
                    f"checkpoint {checkpoint_path} was saved after the step of batch {batch} (epoch {epoch}) failed "
                    f"between backward, which had applied the batch to the embedding tables, and the dense "
                    f"optimizer step: its tables are one batch ahead of its dense weights, and training on from it "
                    f"would apply that batch to the tables twice. Resume from a checkpoint saved before the failure "
                    f"(validate, test and predict may load this one)"
                )

        return sharded_checkpoint.load(
            checkpoint_path,
            lambda: connector.dump_checkpoint(weights_only=False),
            weights_only,
            check,
            strict=self.lightning_module.strict_loading,
        )

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.release_threads()  # validation's loader workers and CPU work get the cores they had
        self._check_equal_batches("val")

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._check_equal_batches("test")

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._check_equal_batches("predict")

    def _check_equal_batches(self, stage: str) -> None:
        """With sharded tables every batch's lookups are all-to-alls that every rank joins: ranks that would
        run different numbers of batches in the starting loop (a loader of one's own, or Lightning's predict
        sampler, which leaves shares unequal) would hang at the longer ones' last batch. Raised on every rank,
        before any batch."""
        if self._data_group is None or not _sharded_prefixes(self.lightning_module):
            return
        counts = list(self.lightning_module.trainer._active_loop.max_batches)
        every = [None] * self.world_size
        dist.all_gather_object(every, counts, group=self._data_group)
        for index, per_rank in enumerate(zip(*every)):
            if len(set(per_rank)) > 1:
                ranks = ", ".join(f"rank {rank}: {count:g}" for rank, count in enumerate(per_rank))
                raise RuntimeError(
                    f"the {stage} dataloader {index} gives the ranks different numbers of batches ({ranks}), and "
                    f"the module's TorchRec tables are sharded: every batch's lookups are all-to-alls that every "
                    f"rank must join, so the ranks would hang at the last batch of the longer shares. Give every "
                    f"rank as many batches: a sampler that fills the shorter shares (with "
                    f"Trainer(use_distributed_sampler=False), torch's DistributedSampler repeats samples to "
                    f"fill them; leave out the repeated samples' outputs), or run {stage} on one process"
                )

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.note_failure(exception)  # where the epoch loop has not already
        self._failed = True
        self.release_threads()
        if self._epoch_loop is not None:  # join the engine's threads before Lightning tears down
            self._epoch_loop.close_engine()

    def release_threads(self) -> None:
        """With ``pin_threads``: every thread pinned gets its own cores back (pinned again after the next
        training batch)."""
        if self.thread_pin is not None:
            self.thread_pin.release()

    @override
    def teardown(self) -> None:
        self._failure_key = None  # this stage's: a failure before the next stage's setup is noted nowhere
        self.release_threads()
        if self._epoch_loop is not None:
            self._epoch_loop.close_engine()
        self._end_own_groups()
        super().teardown()

    def _end_own_groups(self) -> None:
        """Destroy the two gloo groups ``setup_environment`` made for this stage (each stage makes its own),
        so that a process running several stages does not pile them up; not after an exception, when a
        collective of this rank may still be waiting on one (destroying its group would wait for it)."""
        groups, self._data_group, self._loader_group = (self._data_group, self._loader_group), None, None
        if self._failed:
            return
        for group in groups:
            if group is not None:
                dist.destroy_process_group(group)


def _check_default_group(device: torch.device) -> None:
    """Lightning keeps using a default process group that already exists in the process (an earlier run's: it
    is destroyed only at exit); one without a backend for ``device``'s tensors (an earlier GPU run's NCCL,
    then a run on the CPU) would fail at this run's first collective with "No backend type associated with
    device type cpu". Say so before anything runs."""
    backends = process_groups.default_group_backends()
    if backends and device.type not in backends:
        config = ",".join(f"{kind}:{backend}" for kind, backend in backends.items())
        raise RuntimeError(
            f"torch.distributed's default process group already exists in this process (an earlier run made it; "
            f"Lightning keeps it until the process exits) with the backends '{config}': none for {device.type} "
            f"tensors, where this Trainer runs. Call torch.distributed.destroy_process_group() before this "
            f"Trainer, or run it in a process of its own"
        )


def _keep_shards_local(module: torch.nn.Module) -> None:
    """Adds the parameters and buffers of every TorchRec ``DistributedModelParallel`` in ``module`` to its
    ``_ddp_params_and_buffers_to_ignore``. Before validate, test and predict, Lightning's DDP broadcasts all of
    a module's states from rank 0 (``_sync_module_states``, as there is no DDP wrapper then); sharded tables
    hold a different shard on every rank, so that broadcast would fail on shards of different sizes and
    overwrite the other ranks' shards with rank 0's on shards of equal size. The replicated states are still
    broadcast. For fit, torch DDP (which wraps a module without ``hstu_finalize_model_grads``) leaves them out
    of its broadcast and its gradient reduction by the same list."""
    sharded = _sharded_prefixes(module)
    if not sharded:
        return
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    # the names the broadcast goes by: the module's own (DistributedModelParallel renames its members)
    for name, _ in [*module.named_parameters(), *module.named_buffers()]:
        if name.startswith(sharded):
            ignored.add(name)
    module._ddp_params_and_buffers_to_ignore = sorted(ignored)


def _sharded_prefixes(module: torch.nn.Module) -> tuple[str, ...]:
    """``name.`` of every TorchRec ``DistributedModelParallel`` in ``module`` (its tables are sharded)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    return tuple(f"{name}." for name, sub in module.named_modules() if isinstance(sub, DistributedModelParallel))


def _record_mid_epoch_shares(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """A checkpoint saved inside an epoch by Lightning's own loop (``engine=False``) records what the engine's
    loop records (``EngineEpochLoop.on_save_checkpoint``): the train loaders' batch sizes and the number of
    ranks, which a mid-epoch resume under the engine checks before it skips the batches trained."""
    state = (checkpoint.get("loops") or {}).get("fit_loop", {}).get("epoch_loop.state_dict")
    loader = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    if state is None or loader is None or BATCH_SIZES_KEY in state:
        return
    ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    if 0 < ready < trainer.num_training_batches:
        record_shares(state, batch_sizes(loader), trainer.world_size)


def _check_ddp_kwargs(ddp_kwargs: Mapping[str, Any]) -> None:
    """A name neither Lightning's ``DDPStrategy`` nor torch's ``DistributedDataParallel`` takes raises here:
    ``DDPStrategy`` keeps unknown names for ``DistributedDataParallel``, which the strategy does not build on
    one process or around a module that finalises its own gradients, so a misspelt option went unnoticed."""
    own = [name for name in inspect.signature(HSTUPipelineStrategy.__init__).parameters if name not in _NOT_OPTIONS]
    ddp = [name for name in inspect.signature(DDPStrategy.__init__).parameters if name not in _NOT_OPTIONS]
    wrapper = [
        name
        for name in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
        if name not in ("self", "module")
    ]
    for name in ddp_kwargs:
        if name in ddp or name in wrapper:
            continue
        close = difflib.get_close_matches(name, own + ddp + wrapper, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"HSTUPipelineStrategy got an unexpected keyword argument {name!r}{hint} Its own are {', '.join(own)}; "
            "it also takes the arguments of Lightning's DDPStrategy and of torch's DistributedDataParallel"
        )


_NOT_OPTIONS = ("self", "ddp_kwargs", "kwargs")


def _local_path(path: Any) -> str | None:
    """The file fsspec names by ``path``, as Lightning's checkpoint I/O writes and reads it (``~`` expanded,
    ``file://`` removed); None where ``path`` is not local."""
    return fsspec.core.url_to_fs(str(path))[1] if fsspec.utils.get_protocol(str(path)) == "file" else None


def _is_local_non_zip(path: Any) -> bool:
    """Whether ``path`` is a local file that is not a zip archive (torch.save writes one)."""
    local = _local_path(path)
    return local is not None and os.path.isfile(local) and not zipfile.is_zipfile(local)


def _all_ranks_on(group: Any, flag: bool) -> bool:
    return _ask_all_ranks_on(group, flag)()


def _ask_all_ranks_on(group: Any, flag: bool) -> Callable[[], bool]:
    """Starts "is ``flag`` True on every rank of ``group``" (an all-reduce) without waiting, and returns the
    function that waits for the answer (``flag`` itself without a group)."""
    if group is None:
        return lambda: flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    work = dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group, async_op=True)

    def wait_for_all_ranks() -> bool:
        work.wait()
        return bool(value.item())

    return wait_for_all_ranks
