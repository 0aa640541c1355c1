"""The ``lightning-hstu`` command (``fit ...``), plus a callback that notes each rank's pid and step, for a
test that stops a rank mid-training from outside; run by test_watchdog_two_gpus.py.

    python fit_noting_steps.py fit --config CFG ... --trainer.callbacks+='{"class_path":
        "fit_noting_steps.NoteSteps", "init_args": {"directory": DIR}}'

Each rank writes ``<pid> <global step>`` to DIR/rank<R>.step after every batch.
"""

import os
import sys
from pathlib import Path

from lightning.pytorch import Callback


class NoteSteps(Callback):
    def __init__(self, directory: str):
        self.directory = Path(directory)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        note = self.directory / f"rank{trainer.global_rank}.step"
        note.with_suffix(".tmp").write_text(f"{os.getpid()} {trainer.global_step}")
        note.with_suffix(".tmp").replace(note)


if __name__ == "__main__":
    from lightning_hstu.cli import main

    sys.exit(main())
