"""Lightning's per-batch hook calls, less the calls of hooks that nothing overrides.

Every training batch Lightning calls six hooks whose defaults do nothing (``on_train_batch_start``,
``on_before_zero_grad``, ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``,
``on_train_batch_end``) on every callback and on the LightningModule, each call through ``trainer.call``'s
dispatchers: a profiler section, and ``_current_fx_name`` set and reset on the module (an ``nn.Module``
attribute write, the slow path). Skipping those that nothing overrides took 31-111 us off the toy step's 450-750
us on the 2-core CPU machine (BENCHMARKS.md). While the engine's epoch loop runs, ``skipping_idle_hooks``
puts dispatchers in front of Lightning's that return at once where the hook is one of those six, the module's
(or every callback's) is the default, and the loop's trainer's profiler is Lightning's ``PassThroughProfiler``
(which records nothing); any other call goes to Lightning's dispatcher unchanged, so that what runs, in which order,
with which ``_current_fx_name``, is Lightning's. With a profiler every call is made, as Lightning makes it,
so that its report lists them.
"""

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer import call

IDLE_BY_DEFAULT = frozenset(
    {
        "on_train_batch_start",
        "on_before_zero_grad",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
    }
)
"""The per-batch training hooks whose defaults, on ``Callback`` and on ``LightningModule``, do nothing."""

_lock = threading.Lock()
_running: Counter = Counter()  # trainer -> epoch loops of it running with the dispatchers in place
_lightning_callback_hooks = call._call_callback_hooks
_lightning_module_hook = call._call_lightning_module_hook


def _skipping(trainer: "pl.Trainer") -> bool:
    return trainer in _running and type(trainer.profiler) is PassThroughProfiler


def _is_default(hook: Any, default: Any) -> bool:
    """Whether the bound ``hook`` is the class default ``default`` (a function set on the instance is not)."""
    return getattr(hook, "__func__", None) is default


def _callback_hooks(trainer, hook_name, *args, monitoring_callbacks=None, **kwargs):
    if hook_name in IDLE_BY_DEFAULT and monitoring_callbacks is None and _skipping(trainer):
        default = getattr(pl.Callback, hook_name)
        if all(_is_default(getattr(callback, hook_name), default) for callback in trainer.callbacks):
            return None
    return _lightning_callback_hooks(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs)


def _module_hook(trainer, hook_name, *args, pl_module=None, **kwargs):
    if hook_name in IDLE_BY_DEFAULT and _skipping(trainer):
        module = pl_module or trainer.lightning_module
        if module is not None and _is_default(getattr(module, hook_name), getattr(pl.LightningModule, hook_name)):
            return None
    return _lightning_module_hook(trainer, hook_name, *args, pl_module=pl_module, **kwargs)


@contextlib.contextmanager
def skipping_idle_hooks(trainer: "pl.Trainer") -> Iterator[None]:
    """Inside: ``trainer.call``'s callback and module dispatchers skip ``trainer``'s idle per-batch hooks when it
    has no profiler; other trainers' calls are Lightning's. Nested and concurrent uses share one installation,
    removed when the last ends."""
    with _lock:
        if not _running:
            call._call_callback_hooks, call._call_lightning_module_hook = _callback_hooks, _module_hook
        _running[trainer] += 1
    try:
        yield
    finally:
        with _lock:
            _running[trainer] -= 1
            if not _running[trainer]:
                del _running[trainer]
            if not _running:  # put Lightning's back, unless another patch replaced ours meanwhile
                if call._call_callback_hooks is _callback_hooks:
                    call._call_callback_hooks = _lightning_callback_hooks
                if call._call_lightning_module_hook is _module_hook:
                    call._call_lightning_module_hook = _lightning_module_hook
