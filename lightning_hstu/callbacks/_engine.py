"""How callbacks reach the engine."""


def observe_engine(trainer, observer) -> bool:
    """Have the engine call ``observer`` around every task (see ``engine.TaskObserver``); False when the
    trainer's strategy has no engine (the callback then does nothing)."""
    observers = getattr(trainer.strategy, "engine_observers", None)
    if observers is None:
        return False
    if observer not in observers:
        observers.append(observer)
    return True
