"""Lightning's per-batch hook calls, made as Lightning makes them, at less host cost.

Every training batch Lightning dispatches a dozen hooks through ``trainer.call``'s dispatchers (callbacks',
the LightningModule's, the strategy's). Each dispatch writes a debug log line, opens a profiler section
(whose name is formatted every time: for a callback from its ``state_key``, a ``repr`` of its settings), and
sets and resets ``_current_fx_name`` on the module, an ``nn.Module`` attribute write that takes the slow path
(three ``isinstance`` checks against parameter and buffer types, through their metaclasses). While the
engine's epoch loop runs, ``skipping_idle_hooks`` puts dispatchers in front of Lightning's that, for the
loop's trainer when its profiler is Lightning's ``PassThroughProfiler`` (which records nothing) and Lightning's
``call`` logger does not log debug lines:

- return at once for the six per-batch hooks whose defaults do nothing (``on_train_batch_start``,
  ``on_before_zero_grad``, ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``,
  ``on_train_batch_end``) where the module's is the default, and call a callback's only where it overrides
  one (in its class or on the instance): skipping them took 31-111 us off the toy step's 450-750 us on the
  2-core CPU machine (BENCHMARKS.md);
- make every other call as Lightning's dispatcher makes it (the same function, arguments, order and
  ``_current_fx_name``, restored afterwards, and left as it is when the hook raises), without the log line
  and the profiler section, with ``_current_fx_name`` written straight into the module's ``__dict__`` where
  its class keeps ``nn.Module.__setattr__`` (that name is never a parameter, buffer or submodule).

Any other call goes to Lightning's dispatcher unchanged: another trainer's, one with a profiler (so that its
report lists every hook as under Lightning's loop), one while Lightning's ``call`` logger logs debug lines,
and a callback call restricted to the monitoring callbacks or to the others. The three Lightning dispatchers
mirrored here are in ``_lightning_compat.MIRRORED``: a Lightning whose dispatchers changed fails that check.
"""

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
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
_lightning_strategy_hook = call._call_strategy_hook
_module_setattr = torch.nn.Module.__setattr__


def _fast(trainer: "pl.Trainer") -> bool:
    """Whether ``trainer``'s calls are this module's to make: its engine loop runs, it has no profiler, and
    Lightning's dispatchers would log nothing."""
    return (
        trainer in _running
        and type(trainer.profiler) is PassThroughProfiler
        and not call.log.isEnabledFor(logging.DEBUG)
    )


def _is_default(hook: Any, default: Any) -> bool:
    """Whether the bound ``hook`` is the class default ``default`` (a function set on the instance is not)."""
    return getattr(hook, "__func__", None) is default


def _set_fx_name(module: "pl.LightningModule", name: str | None) -> None:
    """``module._current_fx_name = name``, straight into its ``__dict__`` where its class keeps
    ``nn.Module.__setattr__`` (which ends there for a name that is no parameter, buffer or submodule)."""
    if type(module).__setattr__ is _module_setattr:
        module.__dict__["_current_fx_name"] = name
    else:
        module._current_fx_name = name


def _callback_hooks(trainer, hook_name, *args, monitoring_callbacks=None, **kwargs):
    if monitoring_callbacks is not None or not _fast(trainer):
        return _lightning_callback_hooks(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs)
    hooks = [getattr(callback, hook_name) for callback in trainer.callbacks]
    if hook_name in IDLE_BY_DEFAULT:
        default = getattr(pl.Callback, hook_name)
        hooks = [fn for fn in hooks if not _is_default(fn, default)]
        if not hooks:
            return None
    module = trainer.lightning_module
    if module:
        previous = module._current_fx_name
        _set_fx_name(module, hook_name)
    for fn in hooks:
        if callable(fn):
            fn(trainer, trainer.lightning_module, *args, **kwargs)
    if module:
        _set_fx_name(module, previous)
    return None


def _module_hook(trainer, hook_name, *args, pl_module=None, **kwargs):
    module = pl_module or trainer.lightning_module
    if module is None or not _fast(trainer):
        return _lightning_module_hook(trainer, hook_name, *args, pl_module=pl_module, **kwargs)
    fn = getattr(module, hook_name)
    if hook_name in IDLE_BY_DEFAULT and _is_default(fn, getattr(pl.LightningModule, hook_name)):
        return None
    if not callable(fn):
        return None
    previous = module._current_fx_name
    _set_fx_name(module, hook_name)
    output = fn(*args, **kwargs)
    _set_fx_name(module, previous)
    return output


def _strategy_hook(trainer, hook_name, *args, **kwargs):
    if not _fast(trainer):
        return _lightning_strategy_hook(trainer, hook_name, *args, **kwargs)
    module = trainer.lightning_module
    previous = module._current_fx_name
    _set_fx_name(module, hook_name)
    fn = getattr(trainer.strategy, hook_name)
    if not callable(fn):
        return None  # as Lightning's: the module keeps the hook's name
    output = fn(*args, **kwargs)
    _set_fx_name(module, previous)
    return output


_OURS = {
    "_call_callback_hooks": _callback_hooks,
    "_call_lightning_module_hook": _module_hook,
    "_call_strategy_hook": _strategy_hook,
}
_LIGHTNINGS = {
    "_call_callback_hooks": _lightning_callback_hooks,
    "_call_lightning_module_hook": _lightning_module_hook,
    "_call_strategy_hook": _lightning_strategy_hook,
}


@contextlib.contextmanager
def skipping_idle_hooks(trainer: "pl.Trainer") -> Iterator[None]:
    """Inside: ``trainer.call``'s callback, module and strategy dispatchers are this module's for ``trainer``
    (see above); other trainers' calls are Lightning's. Nested and concurrent uses share one installation,
    removed when the last ends."""
    with _lock:
        if not _running:
            for name, dispatcher in _OURS.items():
                setattr(call, name, dispatcher)
        _running[trainer] += 1
    try:
        yield
    finally:
        with _lock:
            _running[trainer] -= 1
            if not _running[trainer]:
                del _running[trainer]
            if not _running:  # put Lightning's back, unless another patch replaced ours meanwhile
                for name, dispatcher in _OURS.items():
                    if getattr(call, name) is dispatcher:
                        setattr(call, name, _LIGHTNINGS[name])
