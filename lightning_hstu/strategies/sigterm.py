"""SIGTERM on several ranks without a collective in the signal handler.

Lightning (2.6) answers SIGTERM with a handler that, besides setting ``trainer.received_sigterm`` and passing
the signal to the ranks its launcher started, broadcasts a tensor on the default process group. A handler
runs between two bytecodes of the main thread, wherever that thread is, so that broadcast is paired with
whatever collective the other ranks issue next on the default group (a gradient all-reduce, another rank's
own handler): a 2-rank fit given SIGTERM hung in 1 of 4 runs on gloo, under Lightning's DDP strategy too.

``SigtermNotice`` replaces that handler under ``HSTUPipelineStrategy``: it records the signal and passes it on
as Lightning does, with no collective. Under the engine on several ranks the ranks then agree between two
steps (the epoch loop's per-batch check, on the strategy's gloo group): every rank stops at the same batch
when any rank received SIGTERM, and no rank raises alone (a rank that stopped by itself, at an epoch's end
or in validation, would leave the others waiting in their next collective). Each check asks the ranks
without waiting and reads the answer at the next check, while the step between them runs: no rank waits
for the others' hosts between two steps, and a SIGTERM stops the ranks one batch later than an answer
waited for at once would. Elsewhere (one process, ``engine=False``, validate, test, predict) the signal
sets ``trainer.received_sigterm`` at once, as Lightning's handler does, and Lightning's loops act on it.
"""

import logging
from collections.abc import Callable
from types import FrameType
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_prefixed_message

log = logging.getLogger(__name__)


class SigtermNotice:
    """The SIGTERM handler the strategy puts in place of Lightning's ``_sigterm_notifier_fn``.

    ``agreed``: the ranks decide together between steps (``stop``); otherwise the signal sets the trainer's
    ``received_sigterm`` at once."""

    def __init__(self, trainer: Any, agreed: bool) -> None:
        self.trainer = trainer
        self.agreed = agreed
        self.received = False
        """This rank received SIGTERM (under ``agreed``: not yet acted on by every rank)."""
        self._answer: Callable[[], bool] | None = None
        """The last check's question to the ranks, read at the next check (``stop``)."""

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        connector = self.trainer._signal_connector
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        if not (self.received or connector.received_sigterm):
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the ranks this process started get it too, as under Lightning
        self.received = True
        if not self.agreed:
            connector.received_sigterm = True

    def stop(self, ask: Callable[[bool], Callable[[], bool]]) -> bool:
        """Between two steps, on every rank: whether any rank had received SIGTERM at the previous check (then
        ``trainer.received_sigterm`` is set on every rank alike); if not, the ranks are asked again, about this
        rank's flag now. ``ask(flag)`` starts "is ``flag`` True on any rank" on every rank without waiting and
        returns the function that waits for the answer (``HSTUPipelineStrategy.ask_any_rank``). A SIGTERM that
        arrives before check k stops every rank at check k + 1, the same on every rank."""
        answer, self._answer = self._answer, None
        if answer is not None and answer():
            self.trainer._signal_connector.received_sigterm = True
            return True
        self._answer = ask(self._here())
        return False

    def settle(self, ask: Callable[[bool], Callable[[], bool]]) -> None:
        """At the end of an epoch, on every rank: reads the last check's answer and, if no, asks the ranks once
        more and waits (``ask`` as for ``stop``), so that no question stays open past the epoch and a SIGTERM
        received during the epoch, its last step included, is known to every rank at its end: then
        ``trainer.received_sigterm`` is set, and the next check (before the next epoch's first batch) stops."""
        answer, self._answer = self._answer, None
        if (answer is not None and answer()) or ask(self._here())():
            self.trainer._signal_connector.received_sigterm = True
            self._answer = _yes

    def _here(self) -> bool:
        """This rank's flag for the ranks' question: it received SIGTERM (or the trainer already knows of one)."""
        return self.received or self.trainer._signal_connector.received_sigterm

    def forget(self) -> None:
        """After an exception ended an epoch: the open question is left to its collective (every rank asked
        it), and not read again."""
        self._answer = None


def _yes() -> bool:
    return True


def install(trainer: Any, agreed: bool) -> SigtermNotice:
    """Put a ``SigtermNotice`` in place of Lightning's SIGTERM notifier on ``trainer``; called from the
    strategy's ``setup``, before the trainer registers its signal handlers (which read the notifier then)."""
    notice = SigtermNotice(trainer, agreed)
    trainer._signal_connector._sigterm_notifier_fn = notice
    return notice
