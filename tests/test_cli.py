"""The ``lightning-hstu`` command a user runs: the presets table, a custom plan, the demo."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hstu import PRESET_NAMES, make_plan
from lightning_hstu.cli import ConfigError, main
from lightning_hstu.models.toy import ToyRecommender


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_presets_prints_one_row_per_preset_with_threads_and_waits(capsys):
    code, out, _ = run_cli(capsys, "presets")
    assert code == 0
    rows = out.strip().splitlines()
    assert rows[0].split()[:3] == ["preset", "cascade", "depth"]
    assert [row.split()[0] for row in rows[1:]] == list(PRESET_NAMES)
    d6 = next(row for row in rows if row.startswith("default_d6"))
    assert "io: h2d@5 start_shuffle@4 finish_shuffle@3 | compute:" in d6
    assert d6.rstrip().endswith("finish_shuffle->start_input_dist")
    d3 = next(row for row in rows if row.startswith("default_d3"))
    assert d3.rstrip().endswith("none")


def test_presets_marks_the_capturable_tasks(capsys):
    code, out, _ = run_cli(capsys, "presets", "-v", "--capture-graphs", "per_task_d3")
    assert code == 0
    assert "forward: forward@0[graph]" in out and "backward: backward@0[graph]" in out
    assert "optimizer_step: optimizer_step@0[graph]" in out
    assert out.count("[graph]") == 3
    assert "[graph]" not in run_cli(capsys, "presets", "-v", "per_task_d3")[1]


def test_presets_verbose_says_where_each_preset_wins_and_loses(capsys):
    from lightning_hstu.hstu.presets import PRESET_NAMES, PRESET_NOTES

    assert set(PRESET_NOTES) == set(PRESET_NAMES)
    code, out, _ = run_cli(capsys, "presets", "-v")
    assert code == 0 and out.count("\nmeasured: ") == len(PRESET_NAMES)
    assert f"measured: {PRESET_NOTES['per_task_d3']}" in run_cli(capsys, "presets", "-v", "per_task_d3")[1]
    assert "measured:" not in run_cli(capsys, "presets", "-v", "--cascade", "d6")[1]  # a custom plan: not measured


def test_presets_shows_a_custom_plan(capsys):
    code, out, _ = run_cli(capsys, "presets", "-v", "--cascade", '{"h2d": 1}', "--thread-map", "per_task")
    assert code == 0
    assert "custom: cascade custom, depth 2, 14 threads" in out
    assert "waits: h2d -> start_shuffle" not in out  # different lookaheads: no wait


def test_plan_options_change_the_named_preset_as_the_strategy_does(capsys):
    from lightning_hstu import HSTUPipelineStrategy

    code, out, _ = run_cli(capsys, "presets", "-v", "full_split_d3", "--cascade", "d6")
    assert code == 0
    assert out.strip() == make_plan("d6", "full_split").describe()
    assert out.strip() == HSTUPipelineStrategy("full_split_d3", lookahead="d6").plan.describe()
    code, out, _ = run_cli(capsys, "presets", "-v", "--thread-map", "none")  # no name: default_d6's plan
    assert code == 0 and out.startswith("custom: cascade d6, depth 6, 1 thread (legacy")
    code, _, err = run_cli(capsys, "presets", "default_d3", "default_d6", "--cascade", "d3")
    assert code == 2 and "change one preset's plan, got 2 presets: default_d3, default_d6" in err


def test_no_prefetch_applies_to_every_preset_shown(capsys):
    code, out, _ = run_cli(capsys, "presets", "--no-prefetch")
    assert code == 0
    assert [row.split()[0] for row in out.strip().splitlines()[1:]] == list(PRESET_NAMES)
    assert "prefetch_embeddings->backward" not in out


def test_bad_plans_exit_2_with_the_plan_error(capsys):
    code, _, err = run_cli(capsys, "presets", "default_d4")
    assert code == 2
    assert "unknown preset 'default_d4'; valid presets: legacy_none, default_d3" in err
    code, _, err = run_cli(capsys, "presets", "--thread-map", '{"h2d": "io"}')
    assert code == 2 and "thread_map misses tasks 'start_shuffle'" in err
    code, _, err = run_cli(capsys, "presets", "--cascade", "{not json")
    assert code == 2 and "--cascade is not valid JSON" in err


def test_a_ticket_order_typed_with_spaces_and_a_plot_path_that_is_a_file(capsys, tmp_path):
    order = list(make_plan("d6", "default").ticket_order)
    code, spaced, err = run_cli(capsys, "presets", "-v", "--ticket-order", ", ".join(order))
    assert code == 0, err  # refused before, its "got" list reading like the valid one
    assert spaced == run_cli(capsys, "presets", "-v", "--ticket-order", ",".join(order))[1]
    (tmp_path / "plots").write_text("a file of the user's")
    code, _, err = run_cli(capsys, "presets", "--plot", str(tmp_path / "plots"))
    assert code == 2 and "is a file; give a folder" in err  # a FileExistsError traceback before
    code, _, err = run_cli(capsys, "presets", "--plot", str(tmp_path / "plots" / "sub"))
    assert code == 2 and f"{tmp_path / 'plots'} is a file; give a folder" in err  # NotADirectoryError before


def test_demo_trains_the_toy_model_and_prints_per_task_timing(capsys):
    code, out, _ = run_cli(capsys, "demo", "--preset", "full_split_d3", "--steps", "6")
    assert code == 0
    assert "losses identical to legacy_none: True" in out
    table = out[out.index("task ") :]
    for task in ("h2d", "forward", "watchdog"):
        assert any(
            line.split()[:3] == [task, line.split()[1], "6"]
            for line in table.splitlines()
            if line.startswith(task + " ")
        )


def test_demo_changes_the_preset_it_is_given(capsys):
    code, out, _ = run_cli(capsys, "demo", "--preset", "legacy_none", "--cascade", "d6", "--steps", "2")
    assert code == 0
    assert out.startswith("custom: cascade d6, depth 6, 1 thread (legacy")


def test_the_console_script_is_installed():
    script = Path(sys.executable).parent / "lightning-hstu"
    result = subprocess.run([str(script), "presets", "legacy_none"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].startswith("legacy_none")


EXAMPLE = Path(__file__).parent.parent / "examples" / "toy.yaml"
QUIET_CLI = ["--trainer.max_epochs=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def test_fit_takes_the_preset_from_the_yaml_config(tmp_path):
    from lightning_hstu import HSTUPipelineStrategy
    from lightning_hstu.cli import run_lightning_cli

    cli = run_lightning_cli(["fit", "--config", str(EXAMPLE), f"--trainer.default_root_dir={tmp_path}", *QUIET_CLI])
    assert isinstance(cli.trainer.strategy, HSTUPipelineStrategy)
    assert cli.trainer.strategy.plan.name == "default_d6"
    assert cli.trainer.global_step == 16  # 256 samples / batch 16, one epoch


def test_the_fit_command_ends_with_no_process_group_left(tmp_path, capsys):
    """``lightning-hstu fit`` destroys the process groups once the run ended normally (left to the
    interpreter's exit, gloo's threads can abort a successful process with exit code -6)."""
    import torch.distributed as dist

    code, _, _ = run_cli(capsys, "fit", "--config", str(EXAMPLE), f"--trainer.default_root_dir={tmp_path}", *QUIET_CLI)
    assert code == 0
    assert not dist.is_initialized()


def test_fit_takes_the_strategy_by_name_on_the_command_line(tmp_path):
    from lightning_hstu.cli import run_lightning_cli

    cli = run_lightning_cli(
        [
            "fit",
            "--config",
            str(EXAMPLE),
            "--trainer.strategy=hstu_full_split_d6",
            f"--trainer.default_root_dir={tmp_path}",
            *QUIET_CLI,
        ]
    )
    assert cli.trainer.strategy.plan.name == "full_split_d6"
    assert cli.trainer.global_step == 16


def test_a_class_path_strategy_sets_the_process_groups_timeout_from_step_timeout(tmp_path):
    """LightningCLI passes every default of a ``class_path`` strategy, DDPStrategy's ``timeout`` (30 min)
    among them, which the strategy took as given: 30 min whatever ``step_timeout`` (shorter than a step
    timeout of an hour), where ``--trainer.strategy=hstu_default_d6`` had 21 min."""
    from datetime import timedelta

    from lightning_hstu.cli import run_lightning_cli

    def process_group_timeout(*args: str) -> timedelta:
        cli = run_lightning_cli(
            ["fit", "--config", str(EXAMPLE), f"--trainer.default_root_dir={tmp_path}", *QUIET_CLI, *args]
        )
        return cli.trainer.strategy.process_group_timeout

    fit = ("--trainer.max_steps=1", "--trainer.limit_val_batches=0")
    assert process_group_timeout(*fit) == timedelta(seconds=1260)
    assert process_group_timeout(*fit, "--trainer.strategy=hstu_default_d6") == timedelta(seconds=1260)
    assert process_group_timeout(*fit, "--trainer.strategy.init_args.step_timeout=3600") == timedelta(seconds=7260)
    assert process_group_timeout(*fit, "--trainer.strategy.init_args.timeout=0:05:00") == timedelta(minutes=5)


def test_fit_with_an_unknown_preset_name_lists_the_valid_ones(capsys, tmp_path):
    code, _, err = run_cli(
        capsys,
        "fit",
        "--config",
        str(EXAMPLE),
        "--trainer.strategy=hstu_default_d4",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert code == 2
    assert "unknown strategy 'hstu_default_d4'; the HSTU strategies are: hstu_legacy_none," in err


def test_fit_with_an_unknown_preset_in_init_args_lists_the_valid_ones(tmp_path):
    script = Path(sys.executable).parent / "lightning-hstu"
    result = subprocess.run(
        [
            str(script),
            "fit",
            "--config",
            str(EXAMPLE),
            "--trainer.strategy.init_args.preset=fastest",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "lightning-hstu: error: unknown preset 'fastest'; valid presets: legacy_none, default_d3" in result.stderr
    assert "Traceback" not in result.stderr  # jsonargparse's, around a ValueError quoting every argument, before


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        (
            "--model.init_args.retrieval_loss=xyz",
            "HSTURecommender: unknown retrieval_loss 'xyz'; valid: auto, full, sampled, in_batch",
        ),
        ("--data.init_args.batch_size=0", "MovieLens: batch_size must be at least 1, got 0"),
    ],
)
def test_a_bad_model_or_data_argument_exits_2_with_one_line_naming_the_class(tmp_path, argument, message):
    """The constructor's ValueError came inside jsonargparse's, as a traceback quoting every argument (exit
    code 1). Refused before MovieLens is fetched: the cache folder is not even made."""
    script = Path(sys.executable).parent / "lightning-hstu"
    run, cache = tmp_path / "run", tmp_path / "cache"
    run.mkdir()
    result = subprocess.run(
        [str(script), "fit", "--config", str(EXAMPLE.parent / "movielens.yaml"), argument],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=run,
        env={**os.environ, "LIGHTNING_HSTU_CACHE": str(cache)},
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("lightning-hstu: error:")]
    assert errors == [f"lightning-hstu: error: {message}"]
    assert "Traceback" not in result.stderr
    assert not list(run.iterdir()) and not cache.exists()


class RefusingModel(ToyRecommender):
    def __init__(self, width: int = 1):
        super().__init__()
        if width != 1:
            raise ValueError("a bug of the user's own")


def test_a_value_error_of_a_users_own_model_keeps_jsonargparses_report():
    """Only this package's classes are cut to one line: a user's model, even a subclass of one of them, may
    have a bug, and its traceback is what finds it."""
    with pytest.raises(ValueError, match="a bug of the user's own") as info:
        main(["fit", "--config", str(EXAMPLE), f"--model={__name__}.RefusingModel", "--model.init_args.width=2"])
    assert not isinstance(info.value, ConfigError)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["engine=false", "capture_graphs=true"], "capture_graphs=True needs engine=True"),
        (["engine=false", "pin_threads=0"], "pin_threads needs engine=True"),
        (["pin_threads=-1"], "pin_threads must be None, a CPU core (an int >= 0) or a list of cores"),
    ],
)
def test_conflicting_or_bad_strategy_options_in_a_config_exit_2_with_one_line(capsys, tmp_path, options, message):
    """A ValueError of the strategy came inside jsonargparse's, as a traceback quoting every argument."""
    code, _, err = run_cli(
        capsys,
        "fit",
        "--config",
        str(EXAMPLE),
        *(f"--trainer.strategy.init_args.{option}" for option in options),
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert code == 2
    assert f"lightning-hstu: error: {message}" in err


KNOWN_NOTICES = (
    "TopologyFactory",
    "HeuristicalStorageReservation",
    "dense tensor size",
    "Transformer Engine and Apex",
    "full scope is deprecated",
    "is_fx_tracing",
    "LeafSpec",
)


def test_the_main_job_logs_csv_tests_the_best_epoch_and_prints_the_report_without_known_notices(tmp_path):
    """examples/movielens.yaml with the synthetic histories and a small model in place of ML-100K."""
    import yaml

    from ranks import launch_env

    config = yaml.safe_load((EXAMPLE.parent / "movielens.yaml").read_text())
    config["model"]["init_args"].update(embedding_dim=16, num_heads=1, attention_dim=8, hidden_dim=8, max_seq_len=32)
    config["data"] = {
        "class_path": "lightning_hstu.data.histories.SyntheticHistories",
        "init_args": dict(num_users=96, num_items=200, max_seq_len=32, batch_size=8, negatives=0, length_buckets=4),
    }
    config["trainer"]["max_epochs"] = 2
    (tmp_path / "main.yaml").write_text(yaml.safe_dump(config))

    def lightning_hstu(*args: str) -> subprocess.CompletedProcess:
        script = Path(sys.executable).parent / "lightning-hstu"
        env = launch_env()  # not this process's rendezvous port
        return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)

    result = lightning_hstu("fit", "--config", "main.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    for notice in KNOWN_NOTICES:
        assert notice not in result.stderr, notice
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"epoch", "train/loss", "val/all/HR@10", "val/unseen/NDCG@50", "test/all/MRR"} <= set(header)
    out = result.stdout
    assert "ranked among all items:" in out and "ranked among items not in the user's history:" in out
    assert "most popular" in out and "HSTU " in out
    assert re.search(r"trained [\d,]+ samples in 2 epochs: [\d,]+ samples/s", out)
    assert re.fullmatch(r"wall time [\d.]+ s \(start-up, fit, test\)", out.rstrip().splitlines()[-1])
    assert (tmp_path / "lightning_logs" / "version_0" / "ranking.json").exists()

    # the best validation epoch's checkpoint, and each user's 10 best unrated items predicted from it
    best = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "best.ckpt"
    result = lightning_hstu("predict", "--config", "main.yaml", "--ckpt_path", str(best))
    assert result.returncode == 0, result.stderr[-3000:]
    for notice in (*KNOWN_NOTICES, "ShardedTensor"):
        assert notice not in result.stderr, notice
    rows = (tmp_path / "lightning_logs" / "version_1" / "recommendations.csv").read_text().splitlines()
    assert rows[0] == "user,rank,item,score" and len(rows) == 1 + 96 * 10
    assert "recommendations for 96 users written to lightning_logs/version_1/recommendations.csv" in result.stderr


def test_a_checkpoint_of_another_model_class_is_refused_naming_both(capsys, tmp_path):
    """Lightning's CLI takes a checkpoint file's model class over the config's: the MovieLens HSTU config
    given a ToyRecommender's checkpoint would have run the toy model, named so nowhere but the report (a
    SASRec checkpoint: SASRec's recommendations). Refused before anything is built, as the checkpoint of
    another configuration of the same model is."""
    code, _, _ = run_cli(
        capsys,
        "fit",
        "--config",
        str(EXAMPLE),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2",
        "--trainer.enable_checkpointing=true",
        *QUIET_CLI,
    )
    assert code == 0
    (toy,) = tmp_path.glob("**/*.ckpt")
    movielens = EXAMPLE.parent / "movielens.yaml"
    for subcommand in ("fit", "test", "predict"):
        code, _, err = run_cli(capsys, subcommand, "--config", str(movielens), "--ckpt_path", str(toy))
        assert code == 2
        assert (
            f"--ckpt_path {toy} is a checkpoint of lightning_hstu.models.toy.ToyRecommender, the config's model is "
            "lightning_hstu.models.hstu.HSTURecommender" in err
        )


def test_a_checkpoint_path_that_does_not_exist_exits_2_naming_it(capsys, tmp_path):
    """Lightning's FileNotFoundError came as a traceback, once the process group and the data were set up."""
    missing = tmp_path / "version_0" / "checkpoints" / "best.ckpt"
    for subcommand in ("fit", "validate"):
        code, _, err = run_cli(
            capsys,
            subcommand,
            "--config",
            str(EXAMPLE),
            f"--trainer.default_root_dir={tmp_path}",
            "--ckpt_path",
            str(missing),
            *QUIET_CLI,
        )
        assert code == 2
        assert f"lightning-hstu: error: --ckpt_path {missing}: no such file or directory" in err


def test_help_lists_every_subcommand_and_a_typo_names_them(capsys):
    """Only presets and demo were listed: ``lightning-hstu fitt`` said "choose from 'presets', 'demo'"."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "presets", "demo"):
        assert f"    {name} " in out, name
    with pytest.raises(SystemExit):
        main(["fitt"])
    assert "(choose from 'fit', 'validate', 'test', 'predict', 'presets', 'demo')" in capsys.readouterr().err
