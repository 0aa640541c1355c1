"""The process groups of a rank under a step timeout: their own timeout, the collectives in flight (torch's
flight recorder), their abort, the ranks this process launched, and the note a failing rank leaves for the
others in the default group's store.

The rule for the process groups' timeout: ``2 * step_timeout + 60 s`` unless the strategy is given
``timeout=`` itself. The step watchdog fires first for any hang inside a step: a collective is issued at
most one step ahead of the step that waits for it, so it is at most ``2 * step_timeout`` old when the
watchdog fires, and the minute covers the report and the exit. Outside the steps (validation, epoch ends,
the barrier after a checkpoint is written) the process groups' timeout is what bounds a hang.
"""

import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives torch's flight recorder keeps (the newest) when the environment does not say."""

AGREEMENT_GROUP = "hstu_rank_agreement"
"""The description of the gloo group on which the ranks agree during a step (every rank's loss is finite)
and between steps (whether a rank received SIGTERM)."""

LOADER_GROUP = "hstu_loader_agreement"
"""The description of the gloo group on which the ranks agree, per batch, that each has one: the loader
thread's, which pulls while the steps run, so that its collectives never interleave with the others'."""


def process_group_timeout(step_timeout: float) -> timedelta:
    return timedelta(seconds=2 * step_timeout + 60)


def default_group_backends() -> dict[str, str]:
    """The default process group's backend per device type (``{"cuda": "nccl"}``, ``{"cpu": "gloo", "cuda":
    "gloo"}``, ...); empty when there is no default group."""
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    return dict(pair.split(":") for pair in str(dist.get_backend_config()).split(","))


def end_process_groups() -> None:
    """Destroy every process group of this process, as PyTorch advises at the end of a training process that
    ended normally: left to the interpreter's exit, gloo's threads can abort it ("terminate called without an
    active exception", exit code -6) although the run succeeded. Not after an error: a rank may still be
    inside a collective, which a gloo group's destruction would wait for."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def enable_flight_recorder() -> None:
    """Have torch's flight recorder keep the last collectives of every process group (NCCL and gloo),
    unless the environment already sizes it (``TORCH_FR_BUFFER_SIZE``, or its older name
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``; 0 turns it off). Read when the first process group is created."""
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)


def collectives_in_flight() -> list[str]:
    """The collectives this process issued that have not completed, from torch's flight recorder, one line
    each: ``flight recorder: gloo:all_to_all #57 on process group 0 (default_pg), scheduled 5.2 s ago by
    thread 'compute', sizes [[12]]``."""
    c10d = torch._C._distributed_c10d
    dumps = [getattr(c10d, name) for name in ("_dump_nccl_trace", "_dump_fr_trace") if hasattr(c10d, name)]
    if not dumps:
        return ["flight recorder: not in this torch build"]
    entries, seen, failures = [], set(), []
    for dump in dumps:
        try:
            trace = pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=True))
        except Exception as exc:  # one backend's recorder failing must not hide the other's
            failures.append(f"flight recorder: {dump.__name__} failed: {exc!r}")
            continue
        for entry in trace.get("entries", []):
            key = (
                tuple(entry.get("process_group", ())),
                entry.get("collective_seq_id"),
                entry.get("p2p_seq_id"),
                entry.get("profiling_name"),
            )
            if key not in seen and not entry.get("retired", False) and entry.get("state") != "completed":
                seen.add(key)
                entries.append(entry)
    if not entries and os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")) == "0":
        return ["flight recorder: off (TORCH_FR_BUFFER_SIZE=0)"]
    threads = {str(t.ident): t.name for t in threading.enumerate()}
    return [
        *(_describe(entry, threads) for entry in sorted(entries, key=lambda e: e.get("time_created_ns", 0))),
        *failures,
    ]


def _describe(entry: dict, threads: dict[str, str]) -> str:
    name, description = (list(entry.get("process_group", ())) + ["?", "?"])[:2]
    group = f"{name} ({description})" if description and description != "undefined" else str(name)
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    age = (time.time_ns() - entry["time_created_ns"]) / 1e9 if entry.get("time_created_ns") else None
    thread_id = str(entry.get("thread_id", ""))
    thread = threads.get(thread_id, entry.get("thread_name") or thread_id or "?")
    when = "" if age is None else f" {age:.1f} s ago"
    return (
        f"flight recorder: {entry.get('profiling_name', '?')} #{seq} on process group {group}, "
        f"{entry.get('state', '?')}{when} by thread '{thread}', sizes {entry.get('input_sizes', '?')}"
    )


def abort_process_groups() -> None:
    """Abort every process group of this process (``ProcessGroupNCCL.abort()`` frees the threads that wait
    on its collectives; a gloo collective cannot be aborted and keeps waiting until the process ends)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort_all is not None:
        abort_all()
        return
    for group in list(dist.distributed_c10d._world.pg_map):
        group.abort()


def end_launched_ranks(processes: Sequence[subprocess.Popen], wait: float) -> None:
    """Give the ranks this process launched ``wait`` seconds to end (their own watchdogs report and end
    them), then kill those still running: a stopped process, or one stuck where nothing can end it."""
    deadline = time.monotonic() + wait
    for local_rank, process in enumerate(processes, start=1):
        try:
            code = process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            print(
                f"local rank {local_rank} (pid {process.pid}) was still running {wait:g} s after this rank's "
                f"watchdog ended its step: killed",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"local rank {local_rank} (pid {process.pid}) ended with exit code {code}", file=sys.stderr, flush=True
            )


FAILURE_LINGER_S = 2.0
"""At most how long a rank that noted its failure waits for every other rank to have read it (or to have
failed too) before it goes on to end: the others ask once a second (``watchdog.PEER_CHECK_S``), and the
store they read it from may be held by this rank's process (rank 0's, under Lightning's launcher)."""


def note_failure(key: str, rank: int, text: str) -> bool:
    """Leave ``text`` (this rank's failure) under ``key`` in the default group's store for the other ranks,
    unless a rank left one there first (then this rank counts as having read it). Whether it was left."""
    store = dist.distributed_c10d._get_default_store()
    if store.check([key]):
        store.add(f"{key}/read", 1)
        return False
    store.set(key, f"{rank}\n{text}")
    return True


def wait_until_read(key: str, others: int, seconds: float) -> None:
    """Wait, at most ``seconds``, until ``others`` ranks have read the failure under ``key`` (or noted one of
    their own)."""
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + seconds
    while store.add(f"{key}/read", 0) < others and time.monotonic() < deadline:
        time.sleep(0.05)


def noted_failure(key: str, rank: int) -> str | None:
    """Another rank's failure under ``key`` in the default group's store (None: none noted); reading it counts
    this rank among those that read it. Raises where the store cannot be reached (its host, rank 0's process,
    may have ended, after a failure or a finished run alike: not a failure to report by itself)."""
    store = dist.distributed_c10d._get_default_store()
    if not store.check([key]):
        return None
    by, _, text = store.get(key).decode(errors="replace").partition("\n")
    if by == str(rank):
        return None
    store.add(f"{key}/read", 1)
    return text
