"""Checkpoints of modules with sharded tables, through torch.distributed.checkpoint (DCP).

TorchRec's sharded tables appear in ``state_dict()`` as ``ShardedTensor``s: every rank holds other rows,
so rank 0 alone cannot write them, and ``torch.load`` cannot read them back. A checkpoint of such a
module is therefore a directory: DCP writes each rank's shards of every entry of the Lightning checkpoint
that holds a sharded tensor (the module's ``state_dict``, the fused sparse optimizer's state), and rank 0
writes the rest (loops, dense optimizer, callbacks, hyper-parameters) to ``lightning.pt`` beside them.
On load DCP reads the shards into the live tensors of the running module, laid out as the current ranks
shard them, which need not be how the saving ranks did.

Saves are atomic. Every rank writes into a hidden sibling directory, rank 0 adds ``lightning.pt`` and then
renames the directory into place (an atomic exchange where a checkpoint of that name exists, as
``last.ckpt`` does). A failure at any point leaves whatever was under the final name as it was. One save
id, recorded among the shards and in ``lightning.pt``, is checked on load: the shards of one save are never
combined with the trainer state of another.

Loading runs no code from the checkpoint unless asked. With ``weights_only`` (the default, as for
``torch.load``) ``lightning.pt`` is read by ``torch.load(weights_only=True)``, DCP's ``.metadata`` (a
pickle) by an unpickler that builds DCP's metadata types and nothing else, and any non-tensor entry among
the shards by ``torch.load(weights_only=True)``. With ``weights_only=False`` a checkpoint directory is
code: ``torch.load`` and DCP's own reader unpickle whatever it holds, so load only directories you trust
as you would trust a program.
"""

import contextlib
import ctypes
import errno
import glob
import os
import pathlib
import pickle
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor

from ..loops.errors import CheckpointError

LIGHTNING_FILE = "lightning.pt"
"""The entries without sharded tensors, written by rank 0 alone."""
SHARDED_KEYS = "hstu_sharded_keys"
"""Which entries of the checkpoint DCP holds (recorded in ``LIGHTNING_FILE``)."""
SAVE_ID = "hstu_save_id"
"""The save's id: a hex string in ``LIGHTNING_FILE``, its 16 bytes as a uint8 tensor among the shards."""
METADATA_FILE = ".metadata"
"""DCP's index of the shards (a pickle), written by its coordinator rank."""


def holds_sharded(value: Any) -> bool:
    """Whether ``value`` (a tensor or nested dicts/lists of them) contains a sharded tensor."""
    if isinstance(value, (ShardedTensor, DTensor)):
        return True
    if isinstance(value, dict):
        return any(holds_sharded(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_sharded(v) for v in value)
    return False


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / LIGHTNING_FILE).is_file()


def check_not_partial(path: str | Path) -> None:
    """A directory with DCP's shards or index but no ``lightning.pt`` (a save that did not finish, a file
    removed) raises ``CheckpointError`` naming it; Lightning's load would fail with ``IsADirectoryError``."""
    path = Path(path)
    if path.is_dir() and ((path / METADATA_FILE).exists() or any(path.glob("*.distcp"))):
        raise CheckpointError(
            f"checkpoint {path} holds shards but no {LIGHTNING_FILE} (the trainer state rank 0 writes last): its "
            f"save did not finish or the file was removed. Load another checkpoint"
        )


def unreadable(file: str | Path, error: BaseException, reason: str | None = None) -> CheckpointError:
    """A checkpoint file that its reader could not parse, named: torch's and pickle's own errors name no file
    (a ``.ckpt`` cut short raises ``OSError: [Errno 22] Invalid argument``, an empty one a bare ``EOFError``).
    ``reason`` says what is wrong in place of ``error`` where the reader's own words mislead."""
    return CheckpointError(
        f"checkpoint file {file} could not be read ({reason or _describe(error)}): it is truncated or damaged (a "
        f"save or copy that did not finish, a disk error) or not a checkpoint. Load another checkpoint"
    )


def new_save_id() -> str:
    return uuid.uuid4().hex


# ----- saving ---------------------------------------------------------------------------------------------


def save(
    checkpoint: dict[str, Any],
    path: str | Path,
    save_id: str,
    is_global_zero: bool,
    from_rank_zero: Callable[[Any], Any],
) -> None:
    """Every rank calls this with the same ``save_id`` (DCP's save is a collective). ``from_rank_zero(x)``
    returns rank 0's ``x`` on every rank (a broadcast): how rank 0 tells the others whether its part
    succeeded, so that a failure there is an error on every rank rather than a hang at the next barrier.
    Trainer.save_checkpoint waits for every rank after this."""
    path = Path(path)
    staging = _staging(path, save_id)
    sharded = {key: value for key, value in checkpoint.items() if holds_sharded(value)}
    try:
        dcp.save({**sharded, SAVE_ID: _id_tensor(save_id)}, checkpoint_id=staging)
    except BaseException as error:  # DCP raises on every rank when any rank failed
        if is_global_zero:
            _remove(staging)
        if not isinstance(error, (Exception, CheckpointException)):
            raise
        raise _save_error(path, _describe(_first_failure(error))) from error
    failure = _finish_on_rank_zero(checkpoint, sharded, staging, path, save_id) if is_global_zero else None
    _raise_rank_zero_failure(path, failure, from_rank_zero)


def save_file(
    checkpoint: dict[str, Any], path: str | Path, is_global_zero: bool, from_rank_zero: Callable[[Any], Any]
) -> None:
    """A checkpoint without sharded tensors, as one file written by rank 0: into a hidden sibling, then renamed
    into place, so that a save that fails or is killed leaves whatever was under ``path`` whole. (Lightning's
    own save writes a temporary file in the system's temporary folder and moves it over ``path``: where that
    folder is on another file system than the checkpoints, the move copies into ``path`` itself, and a kill
    during the copy leaves the checkpoint cut short, the previous one gone.) Every rank calls it: rank 0's
    failure is an error on every rank (``from_rank_zero``, as ``save``'s), not a wait of the others at the
    barrier after it until the process group's timeout."""
    path = Path(path)
    failure = _write_file(checkpoint, path) if is_global_zero else None
    _raise_rank_zero_failure(path, failure, from_rank_zero)


def _raise_rank_zero_failure(path: Path, failure: Exception | None, from_rank_zero: Callable[[Any], Any]) -> None:
    """Rank 0's ``failure`` (None: it worked), raised on every rank as ``_save_error``."""
    reported = from_rank_zero(None if failure is None else _describe(failure))
    if reported is not None:
        raise _save_error(path, reported) from failure


def _staging(path: Path, save_id: str) -> Path:
    """Where a save of ``path`` is written before it is moved into place: a hidden sibling."""
    return path.parent / f".{path.name}.{save_id}.saving"


def _remove_leftovers(path: Path) -> None:
    """The staging siblings of ``path`` that saves killed before they could clean up left behind."""
    for leftover in path.parent.glob(f".{glob.escape(path.name)}.*.saving*"):
        _remove(leftover)


def _write_file(checkpoint: dict[str, Any], path: Path) -> Exception | None:
    """``checkpoint`` into a staging sibling, synced, then renamed over ``path``. Returns the failure (None if
    it worked); nothing under ``path`` changes unless everything did."""
    staging = _staging(path, new_save_id())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(staging, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, path)
    except BaseException as error:
        _remove(staging)
        if not isinstance(error, Exception):
            raise
        return error
    _remove_leftovers(path)
    return None


def _finish_on_rank_zero(
    checkpoint: dict[str, Any], sharded: dict[str, Any], staging: Path, path: Path, save_id: str
) -> Exception | None:
    """Write ``lightning.pt`` and move the staged checkpoint into place. Returns the failure (None if it
    worked); nothing under ``path`` changes unless everything did."""
    rest = {key: value for key, value in checkpoint.items() if key not in sharded}
    rest[SHARDED_KEYS] = sorted(sharded)
    rest[SAVE_ID] = save_id
    try:
        torch.save(rest, staging / LIGHTNING_FILE)
        _move_into_place(staging, path)
    except BaseException as error:
        _remove(staging)
        if not isinstance(error, Exception):
            raise
        return error
    _remove_leftovers(path)
    return None


def _first_failure(error: BaseException) -> BaseException:
    """The exception of the first failed rank, for DCP's exception that wraps every rank's."""
    if isinstance(error, CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _save_error(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"could not save checkpoint {path}: {what}. Nothing under that name changed: a "
        f"checkpoint already there is the previous one, whole"
    )


def _move_into_place(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final`` in one step: a plain rename when ``final`` does not exist, else an
    exchange of the two (after which ``staging`` holds the old checkpoint, removed here)."""
    if not os.path.lexists(final):
        os.rename(staging, final)
        return
    if _exchange(staging, final):
        _remove(staging)
        return
    # No atomic exchange on this system: move the old checkpoint aside first. Should the process die
    # between the two renames, the old checkpoint is whole under the hidden name ``aside``.
    aside = staging.with_name(staging.name + ".old")
    os.rename(final, aside)
    os.rename(staging, final)
    _remove(aside)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is unavailable."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # kernel or file system without it
        return False
    raise OSError(code, f"exchanging {a} and {b}: {os.strerror(code)}")


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _id_tensor(save_id: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(save_id)), dtype=torch.uint8)


# ----- loading --------------------------------------------------------------------------------------------


def load(
    path: str | Path,
    template: Callable[[], dict[str, Any]],
    weights_only: bool | None = None,
    check: Callable[[dict[str, Any]], None] | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """The whole checkpoint; ``template()`` gives the current checkpoint (Lightning's dump of the running
    trainer), whose sharded entries DCP fills in place with the saved values. ``weights_only`` None or
    True runs no code from the checkpoint; False trusts it (see the module's docstring). ``check`` sees the
    entries of ``lightning.pt`` before any shard is loaded (it may raise: nothing is applied then)."""
    path = Path(path)
    safe = weights_only is not False
    checkpoint = _load_lightning_file(path / LIGHTNING_FILE, safe)
    if check is not None:
        check(checkpoint)
    keys = checkpoint.pop(SHARDED_KEYS)
    save_id = checkpoint.pop(SAVE_ID, None)
    current = template()
    missing = [key for key in keys if key not in current]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} holds sharded entries {missing} that the running module does "
            f"not produce (its checkpoint has: {', '.join(sorted(current))})"
        )
    sharded = {key: current[key] for key in keys}
    metadata = _read_metadata(path, safe)
    if strict and "state_dict" in sharded:
        # DCP fills the entries the running module has and ignores the others: a checkpoint of a deeper
        # model (more layers, a ranking head) would load silently, its extra weights dropped
        expected = set(_flat_keys(sharded["state_dict"], "state_dict"))
        saved = [k for k in metadata.state_dict_metadata if k.startswith("state_dict.")]
        unexpected = sorted(k.removeprefix("state_dict.") for k in saved if k not in expected)
        if unexpected:
            raise CheckpointError(
                f"checkpoint {path} holds weights the running module does not have: {', '.join(unexpected)} "
                f"(a model of another configuration? the checkpoint's hyper-parameters: "
                f"{checkpoint.get('hyper_parameters')})"
            )
    if save_id is None:
        warnings.warn(
            f"checkpoint {path} records no save id (written before saves were atomic): whether its "
            f"shards and {LIGHTNING_FILE} come from one save cannot be checked",
            stacklevel=2,
        )
    else:
        sharded[SAVE_ID] = torch.zeros(16, dtype=torch.uint8)
    load_shards(sharded, path, safe, metadata)
    if save_id is not None:
        found = bytes(sharded.pop(SAVE_ID).tolist()).hex()
        if found != save_id:
            raise CheckpointError(
                f"checkpoint {path} mixes two saves: {LIGHTNING_FILE} is of save {save_id}, the "
                f"shards of save {found}; it cannot be resumed (a copy assembled from two "
                f"checkpoints?)"
            )
    checkpoint.update(sharded)
    return checkpoint


def load_shards(state: dict[str, Any], path: str | Path, safe: bool = True, metadata: Any = None) -> None:
    """DCP's load of ``state`` (in place) from the checkpoint directory ``path``; ``safe`` runs no code
    from it: metadata through the restricted unpickler, non-tensor entries through weights_only loads.
    ``metadata``: the directory's, where the caller has read it already."""
    path = Path(path)
    metadata = metadata if metadata is not None else _read_metadata(path, safe)
    if SAVE_ID in state and SAVE_ID not in metadata.state_dict_metadata:
        raise CheckpointError(
            f"checkpoint {path} mixes two saves: {LIGHTNING_FILE} records a save id, its "
            f"shards none (shards of an older checkpoint copied in?)"
        )
    planner = _WeightsOnlyPlanner(path) if safe else DefaultLoadPlanner()
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=_ReaderOf(path, metadata), planner=planner)
    except CheckpointException as error:
        failure = _first_failure(error)
        if isinstance(failure, CheckpointError):
            raise failure from None
        raise CheckpointError(f"could not load the shards of checkpoint {path}: {_describe(failure)}") from error


def _load_lightning_file(file: Path, safe: bool) -> dict[str, Any]:
    try:
        if not safe:
            return torch.load(file, weights_only=False)
        with torch.serialization.safe_globals(_TRAINER_STATE_GLOBALS):
            return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as error:
        if not safe:
            raise unreadable(file, error) from error
        raise _unsafe_error(file, _torch_reason(error)) from None
    except (OSError, EOFError, RuntimeError, ValueError) as error:
        raise unreadable(file, error) from error


_TRAINER_STATE_GLOBALS = [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath]
"""Beyond torch's own weights-only types (tensors, containers, numbers, strings, dtypes), what a trainer
state may hold: paths, in hyper-parameters or callback state. Building a path runs no code of the file."""


def _torch_reason(error: pickle.UnpicklingError) -> str:
    """The line of torch's weights-only error that names what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if "Unsupported global" in line or "GLOBAL" in line]
    return lines[0] if lines else str(error).splitlines()[0]


def _unsafe_error(source: Any, what: str) -> CheckpointError:
    return CheckpointError(
        f"{source} was not loaded: it holds something other than weights and plain data ({what}), and "
        f"weights_only=True (the default) runs no code from a checkpoint. If you trust whoever wrote it as you "
        f"would trust a program, load it with weights_only=False (trainer.fit(..., weights_only=False)); "
        f"or allow the type with torch.serialization.add_safe_globals"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Builds what DCP's ``.metadata`` legitimately holds (its metadata dataclasses, sizes, dtypes, paths)
    and refuses every other global: a pickle can call any function it names."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    }

    def __init__(self, file, path: Path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise _unsafe_error(self._path, f"it refers to {module}.{name}")
        return found

    def _allowed(self, module: str, name: str) -> bool:
        if (module, name) in self._ALLOWED:
            return True
        if module == dcp_metadata.__name__:  # the metadata's own classes and enums, not its functions
            return isinstance(getattr(dcp_metadata, name, None), type)
        return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def _read_metadata(path: Path, safe: bool) -> Any:
    file = path / METADATA_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {METADATA_FILE}: its shards were not completely written")
    with open(file, "rb") as stream:
        try:
            return (_MetadataUnpickler(stream, file) if safe else pickle.Unpickler(stream)).load()
        except CheckpointError:
            raise
        except Exception as error:  # cut short or damaged: pickle's errors name no file
            raise unreadable(file, error) from error


class _ReaderOf(dcp.FileSystemReader):
    """DCP's file reader, given metadata already read (through the restricted unpickler)."""

    def __init__(self, path: Path, metadata: Any):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._metadata, "storage_meta", None) is not None:
            self._metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return self._metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor entry must pass ``torch.load(weights_only=True)``
    before DCP reads it (with ``weights_only=False``, which would run whatever code the bytes name)."""

    def __init__(self, path: Path):
        super().__init__()
        self._path = path

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise _unsafe_error(f"{self._path}, entry {read_item.dest_index.fqn}", _torch_reason(error)) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def _flat_keys(value: Any, prefix: str):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat_keys(v, f"{prefix}.{k}")
    else:
        yield prefix
