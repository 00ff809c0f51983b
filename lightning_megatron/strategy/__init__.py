"""The strategy: Megatron-LM's parallelism wired into Lightning's Trainer, in one package.

``lightning.py`` holds the Lightning class (its hooks and wiring only); ``options.py`` its settings, checked and
normalised once; ``preparation.py`` the set-up steps that turn a module into this rank's part of the parallel model;
``step.py`` one optimizer step (finish, non-finite check, clip, step); ``checkpointer.py`` saving and loading;
``collectives.py`` Lightning's collectives over the layout; the process lifecycle (``launcher.py``,
``processes.py``, ``diagnostics.py``, ``requeue.py``) and what a user sees of the run (``summary.py``,
``lightning_features.py``, ``auto.py``) beside them.
"""

from lightning_megatron.strategy.lightning import Megatron3DStrategy, register
from lightning_megatron.strategy.options import StrategyOptions

__all__ = ["Megatron3DStrategy", "StrategyOptions", "register"]
