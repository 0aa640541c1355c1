"""The ``lightning-hstu`` command: train, validate, test and predict (``fit``, ``validate``, ``test``,
``predict``: Lightning's LightningCLI), inspect plans (``presets``), run the toy demo (``demo``)."""

import argparse
import json
import sys
from pathlib import Path

from .hstu.presets import DEFAULT_PRESET, NO_THREAD_MAP, PRESET_NAMES, PRESET_NOTES, THREAD_MAPS, resolve_plan
from .hstu.tasks import GRAPH_TASKS
from .loops.errors import CheckpointError
from .paths import unused
from .plan import Plan, PlanError

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        if words and words[0] in LIGHTNING_SUBCOMMANDS:
            from .strategies.process_groups import end_process_groups

            run_lightning_cli(argv)  # None: LightningCLI reads sys.argv itself
            end_process_groups()  # the run ended normally
            return 0
        args = _parser().parse_args(words)
        return args.run(args)
    except (PlanError, CheckpointError, ConfigError) as error:
        print(f"lightning-hstu: error: {error}", file=sys.stderr)
        return 2


class ConfigError(ValueError):
    """An argument of the config that the model's or the data module's class, one of this package's, refused:
    the message names the class and quotes its constructor (the strategy's refusals are ``PlanError``s)."""


def run_lightning_cli(argv: list[str] | None):
    """``lightning-hstu fit --config cfg.yaml``: Lightning's own CLI, with the strategy an ordinary argument
    (``--trainer.strategy=hstu_full_split_d6``, or ``class_path: lightning_hstu.HSTUPipelineStrategy``
    with ``init_args: {preset: ...}``). Model and data are chosen by ``class_path`` in the config. The
    resolved config goes under the run's log directory (``RunConfigCallback``)."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    from . import known_warnings  # noqa: F401
    from .strategies import HSTUPipelineStrategy

    class FitThenTestCLI(LightningCLI):
        """``fit`` ends with one ``trainer.test`` when a ``RankingReport`` callback is configured: that
        callback has put the best validation epoch's weights back, and prints the test report."""

        def _parse_ckpt_path(self) -> None:
            _check_checkpoint_exists(self.config)
            _check_checkpoint_model(self.config)
            super()._parse_ckpt_path()

        def before_instantiate_classes(self) -> None:
            self.refusal: PlanError | ConfigError | None = None
            self.parser.add_instantiator(self._strategy, HSTUPipelineStrategy)
            registered = getattr(self.parser, "_instantiators", None) or {}
            for module_type in (LightningModule, LightningDataModule):
                # LightningCLI registered an instantiator of its own for each (it hands the module the
                # hyper-parameters that its checkpoints keep): wrapped, in its place. A jsonargparse that
                # keeps them elsewhere leaves its own report in place.
                lightning_instantiator = registered.get((module_type, True))
                if lightning_instantiator is not None:
                    self.parser.add_instantiator(self._module(lightning_instantiator), module_type)

        def _strategy(self, cls, *args, **kwargs):
            try:
                return cls(*args, **kwargs)
            except PlanError as error:
                self.refusal = error
                raise

        def _module(self, lightning_instantiator):
            """Notes a ValueError of a model or data module class of this package; a class of the user's keeps
            jsonargparse's report, with the traceback its bug needs."""

            def instantiator(cls, *args, applied_instantiation_links: dict, **kwargs):  # Lightning's needs these
                try:
                    return lightning_instantiator(
                        cls, *args, applied_instantiation_links=applied_instantiation_links, **kwargs
                    )
                except ValueError as error:
                    if cls.__module__.startswith("lightning_hstu."):
                        self.refusal = ConfigError(f"{cls.__name__}: {error}")
                    raise

            return instantiator

        def instantiate_classes(self) -> None:
            """A ``PlanError`` of the config's strategy (a mistyped ``init_args.preset``) is raised as itself, a
            ``ValueError`` of this package's model or data module (``retrieval_loss=xyz``, ``batch_size=0``) as
            a ``ConfigError`` naming the class: jsonargparse reports either inside a ValueError of its own that
            quotes every argument of the class."""
            try:
                super().instantiate_classes()
            except ValueError:
                if self.refusal is None:
                    raise
                raise self.refusal from None

        def after_fit(self) -> None:
            from .callbacks import RankingReport

            if any(isinstance(c, RankingReport) for c in self.trainer.callbacks) and not self.trainer.interrupted:
                self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)

    return FitThenTestCLI(
        args=argv, subclass_mode_model=True, subclass_mode_data=True, save_config_callback=_run_config_callback()
    )


def _subcommand_config(config):
    """The parsed arguments of the subcommand run (``fit``, ``test``, ...); empty without one."""
    subcommand = config.get("subcommand")
    return config[subcommand] if subcommand else {}


def _check_checkpoint_exists(config) -> None:
    """Refuse a ``--ckpt_path`` that is not there before anything is set up (Lightning raises
    ``FileNotFoundError`` once the process group and the data are). Lightning's own names for a checkpoint
    it finds (``best``, ``last``, ``hpc``, ``registry[:...]``) and remote paths (``s3://...``) are left to it."""
    ckpt_path = _subcommand_config(config).get("ckpt_path")
    if not ckpt_path:
        return
    ckpt_path = str(ckpt_path)
    if ckpt_path in ("best", "last", "hpc") or ckpt_path.lower().startswith("registry") or "://" in ckpt_path:
        return
    if not Path(ckpt_path).exists():
        raise CheckpointError(f"--ckpt_path {ckpt_path}: no such file or directory")


def _check_checkpoint_model(config) -> None:
    """Refuse ``--ckpt_path`` of another model class than the config's: Lightning's CLI reads a checkpoint
    file's hyper-parameters, its model's class included, over the config, so an HSTU config given a SASRec
    checkpoint fitted, tested or predicted with SASRec, named so only in the report; and an HSTU checkpoint
    (a directory) given to a SASRec config failed with ``IsADirectoryError``."""
    import torch

    from .strategies.sharded_checkpoint import _TRAINER_STATE_GLOBALS, LIGHTNING_FILE

    section = _subcommand_config(config)
    ckpt_path, model = section.get("ckpt_path"), section.get("model")
    wanted = getattr(model, "class_path", None)
    if not ckpt_path or not wanted:
        return
    path = Path(ckpt_path)
    file = path / LIGHTNING_FILE if path.is_dir() else path
    if not file.is_file():
        return  # a folder without that file: Lightning reports it
    try:
        with torch.serialization.safe_globals(_TRAINER_STATE_GLOBALS):  # runs no code of the file
            saved = torch.load(file, weights_only=True, map_location="cpu", mmap=True)
    except Exception:  # noqa: BLE001 (not readable so: the load itself reports it, as it would without this check)
        return
    hparams = saved.get("hyper_parameters") if isinstance(saved, dict) else None
    saved = hparams.get("_class_path") if isinstance(hparams, dict) else None
    if saved is not None and saved != wanted:
        raise CheckpointError(
            f"--ckpt_path {ckpt_path} is a checkpoint of {saved}, the config's model is {wanted}: give the "
            f"checkpoint of a run of that model (or the config of the run that saved it)"
        )


def _run_config_callback():
    from lightning.pytorch.cli import SaveConfigCallback
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    class RunConfigCallback(SaveConfigCallback):
        """Writes the resolved config into the run's own log directory: the logger's (``version_N``), or
        without a logger a new ``<default_root_dir>/lightning_logs/version_N``. Never over an existing file:
        a ``config.yaml`` in the working directory is the user's, and each run keeps its own."""

        def setup(self, trainer, pl_module, stage: str) -> None:
            if self.already_saved:
                return
            log_dir = trainer.log_dir if trainer.loggers else None  # on every rank: it is a broadcast
            if trainer.is_global_zero:
                path = unused(_run_dir(log_dir, trainer.default_root_dir) / self.config_filename)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.parser.save(self.config, str(path), skip_none=False, overwrite=False, multifile=self.multifile)
                rank_zero_info(f"resolved config written to {path}")
            self.already_saved = True

    return RunConfigCallback


def _run_dir(log_dir: str | None, default_root_dir: str) -> Path:
    if log_dir is not None:
        return Path(log_dir)
    logs = Path(default_root_dir) / "lightning_logs"
    taken = [int(p.name[8:]) for p in logs.glob("version_*") if p.name[8:].isdigit()]
    return logs / f"version_{max(taken, default=-1) + 1}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-hstu", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="command")
    for name in LIGHTNING_SUBCOMMANDS:  # run by main() before this parser: listed here for --help and typos
        commands.add_parser(
            name,
            help=f"Lightning's LightningCLI {name} (--config FILE.yaml; `lightning-hstu {name} --help`: its options)",
            add_help=False,
        )

    presets = commands.add_parser("presets", help="print the presets' plans, or a preset's plan with changes")
    presets.add_argument(
        "names",
        nargs="*",
        help=f"presets to show (default: all nine); with --cascade, --thread-map or --ticket-order "
        f"at most one, the plan they change (default: {DEFAULT_PRESET})",
    )
    _add_plan_changes(presets)
    presets.add_argument("--verbose", "-v", action="store_true", help="one block per plan, with tickets")
    presets.add_argument("--plot", metavar="DIR", help="also draw each plan's topology into DIR (PNG and SVG)")
    presets.add_argument(
        "--capture-graphs",
        action="store_true",
        help="mark forward, backward and optimizer_step capturable, as HSTUPipelineStrategy(capture_graphs=True)",
    )
    presets.set_defaults(run=_presets)

    demo = commands.add_parser("demo", help="run a plan over a toy CPU workload and print per-task timing")
    demo.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        help=f"one of: {', '.join(PRESET_NAMES)} (default: {DEFAULT_PRESET}); the options below change its plan",
    )
    _add_plan_changes(demo)
    demo.add_argument("--steps", type=int, default=64, help="batches to train (default 64)")
    demo.set_defaults(run=_demo)
    return parser


def _add_plan_changes(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "changes to a preset's plan",
        "--cascade, --thread-map and --ticket-order replace that part of the preset's plan and keep the rest, as "
        "HSTUPipelineStrategy(preset, lookahead=..., thread_map=...) does; the plan is then named 'custom'. "
        "--no-prefetch changes any plan and keeps its name.",
    )
    group.add_argument("--cascade", help='"d3", "d6" or JSON {"task": lookahead, ...} (tasks not named: 0)')
    group.add_argument(
        "--thread-map",
        help=f'{", ".join(THREAD_MAPS)}, "{NO_THREAD_MAP}" (every task on the '
        f'caller\'s thread) or JSON {{"task": "thread", ...}}',
    )
    group.add_argument("--no-prefetch", action="store_true", help="no prefetch_embeddings -> backward sync")
    group.add_argument("--ticket-order", help="collective tasks in launch order, comma-separated")


def _replaces_parts(args: argparse.Namespace) -> bool:
    return args.cascade is not None or args.thread_map is not None or args.ticket_order is not None


def _plan(args: argparse.Namespace, preset: str, capturable=()) -> Plan:
    """``preset``'s plan with the changes the options ask for (``resolve_plan``, as the strategy)."""
    return resolve_plan(
        preset,
        cascade=_json_or_name(args.cascade, "--cascade"),
        thread_map=_json_or_name(args.thread_map, "--thread-map"),
        prefetch=not args.no_prefetch,
        ticket_order=[name.strip() for name in args.ticket_order.split(",")] if args.ticket_order else None,
        capturable=capturable,
    )


def _json_or_name(text: str | None, option: str):
    if text is None or not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(f"{option} is not valid JSON: {error}") from None


def _presets(args: argparse.Namespace) -> int:
    blocking = args.plot and next(
        (p for p in (Path(args.plot), *Path(args.plot).parents) if p.exists() and not p.is_dir()), None
    )
    if blocking:
        print(
            f"lightning-hstu: error: --plot {args.plot}: {blocking} is a file; give a folder (made if absent)",
            file=sys.stderr,
        )
        return 2
    capturable = GRAPH_TASKS if args.capture_graphs else ()
    names = args.names or PRESET_NAMES
    if _replaces_parts(args):
        if len(args.names) > 1:
            raise PlanError(
                f"--cascade, --thread-map and --ticket-order change one preset's plan, got "
                f"{len(args.names)} presets: {', '.join(args.names)}"
            )
        names = args.names or [DEFAULT_PRESET]
    plans = [_plan(args, name, capturable) for name in names]
    if args.verbose:
        print(
            "\n\n".join(
                plan.describe() + (f"\nmeasured: {PRESET_NOTES[plan.name]}" if plan.name in PRESET_NOTES else "")
                for plan in plans
            )
        )
    else:
        print(format_preset_table(plans))
    if args.plot:
        from .callbacks.pictures import draw_topology

        for plan in plans:
            for path in draw_topology(plan, f"{args.plot}/{plan.name}"):
                print(f"wrote {path}")
    return 0


def format_preset_table(plans: list[Plan]) -> str:
    """One row per plan: name, cascade, depth, threads with their tasks, waits."""
    rows = [("preset", "cascade", "depth", "threads (task@lookahead)", "waits")]
    for plan in plans:
        threads = " | ".join(
            f"{thread}: " + " ".join(f"{n}@{plan.task(n).lookahead}" for n in names)
            for thread, names in plan.threads.items()
        )
        waits = ", ".join(f"{p}->{c}" for p, c in plan.sorted_wait_edges()) or "none"
        rows.append((plan.name, plan.cascade, str(plan.depth), f"({len(plan.threads)}) {threads}", waits))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4] for row in rows)


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo

    if args.steps < 1:
        raise PlanError(f"--steps must be at least 1, got {args.steps}")
    plan = _plan(args, args.preset)
    print(demo(plan, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
