"""The seed's two pictures: the topology of a plan (task -> lookahead column, thread row, stream colour,
wait edges) and the Gantt of a measured step (threads as rows, tasks coloured by stream, red dashed arrows
for the waits that occurred). Each is written as PNG and SVG."""

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

from ..engine import TaskRecord  # noqa: E402
from ..plan import Plan, Stream  # noqa: E402

STREAM_COLORS = {
    Stream.DEFAULT: "#4c72b0",
    Stream.MEMCPY: "#dd8452",
    Stream.DATA_DIST: "#55a868",
    Stream.PREFETCH: "#c44e52",
}


def draw_topology(plan: Plan, path: str | Path) -> list[Path]:
    """Tasks placed by lookahead (columns, highest first) and thread (rows); wait edges in red dashes."""
    threads = list(plan.threads)
    lookaheads = sorted({t.lookahead for t in plan.tasks}, reverse=True)
    cells: dict[tuple[str, int], list[str]] = {}
    for task in plan.tasks:
        cells.setdefault((task.thread, task.lookahead), []).append(task.name)
    # each thread's row is as tall as its tallest stack of tasks at one lookahead
    row_top, top = {}, 0.0
    for thread in threads:
        row_top[thread] = top
        top -= 0.55 * max(len(names) for (t, _), names in cells.items() if t == thread) + 0.9
    position = {
        name: (lookaheads.index(la) * 3.2, row_top[thread] - 0.55 * i)
        for (thread, la), names in cells.items()
        for i, name in enumerate(names)
    }
    fig, ax = plt.subplots(figsize=(3.4 * len(lookaheads) + 1.5, max(3.0, -top * 0.55 + 1)))
    for task in plan.tasks:
        x, y = position[task.name]
        ax.text(
            x,
            y,
            task.name,
            ha="center",
            va="center",
            fontsize=7,
            bbox=dict(boxstyle="round", fc=STREAM_COLORS[task.stream], alpha=0.85, ec="none"),
        )
    for producer, consumer in plan.wait_edges:
        ax.annotate(
            "",
            xy=position[consumer],
            xytext=position[producer],
            arrowprops=dict(arrowstyle="->", color="red", linestyle="--", lw=1),
        )
    ax.set_xticks([i * 3.2 for i in range(len(lookaheads))], [f"lookahead {la}" for la in lookaheads])
    ax.set_yticks([row_top[t] for t in threads], threads)
    _legend(ax)
    ax.set_xlim(-1.8, 3.2 * (len(lookaheads) - 1) + 1.8)
    ax.set_ylim(top + 0.3, 0.8)
    ax.set_title(f"{plan.name}: cascade {plan.cascade}, {len(threads)} thread(s); red: waits inside a step")
    return _save(fig, path)


def draw_gantt(plan: Plan, records: Sequence[TaskRecord], path: str | Path) -> list[Path]:
    """One measured step (or a few): a bar per task run on its thread's row; red dashed arrows from the end
    of each producer a task actually blocked on to the task's start."""
    threads = list(plan.threads)
    origin = min(r.start - r.wait for r in records)
    ends = {}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(threads) + 1.5))
    for r in records:
        row = threads.index(r.thread)
        start, width = (r.start - origin) * 1e3, max(r.duration * 1e3, 1e-3)
        color = STREAM_COLORS[plan.task(r.task).stream]
        ax.barh(row, width, left=start, color=color, alpha=0.4 if r.skipped else 0.9, edgecolor="black", lw=0.3)
        if r.wait > 0:
            ax.barh(row, r.wait * 1e3, left=start - r.wait * 1e3, color="none", edgecolor="red", hatch="//", lw=0)
        ax.text(start + width / 2, row, f"{r.task}@{r.batch}", ha="center", va="center", fontsize=6, rotation=90)
        ends[(r.task, r.step)] = ((r.end - origin) * 1e3, row)
    for r in records:
        for producer in r.waited_on:
            if (producer, r.step) in ends:
                x, y = ends[(producer, r.step)]
                ax.annotate(
                    "",
                    xy=((r.start - origin) * 1e3, threads.index(r.thread)),
                    xytext=(x, y),
                    arrowprops=dict(arrowstyle="->", color="red", linestyle="--", lw=1),
                )
    ax.set_yticks(range(len(threads)), threads)
    ax.invert_yaxis()
    ax.set_xlabel("host time (ms)")
    steps = sorted({r.step for r in records})
    ax.set_title(
        f"{plan.name}: step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} "
        f"(hatched: waiting; red arrows: waits that occurred)"
    )
    _legend(ax)
    return _save(fig, path)


def _legend(ax) -> None:
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STREAM_COLORS.values()]
    ax.legend(handles, [f"stream {s}" for s in STREAM_COLORS], loc="upper right", fontsize=7)


def _save(fig, path: str | Path) -> list[Path]:
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix in (".png", ".svg"):
        target = base.with_suffix(suffix)
        fig.savefig(target, dpi=130, bbox_inches="tight")
        written.append(target)
    plt.close(fig)
    return written
