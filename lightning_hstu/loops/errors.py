"""The error a checkpoint that cannot be saved, loaded or resumed as asked raises."""


class CheckpointError(RuntimeError):
    """A checkpoint refused or not written. The message names the checkpoint and what to do; nothing of it
    was applied (on load) and nothing under its final name changed (on save)."""
