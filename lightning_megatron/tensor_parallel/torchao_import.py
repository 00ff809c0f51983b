"""torchao, an optional dependency (the ``fp8`` and ``qlora`` extras), imported quietly and with a message that says
how to install it.

Its import on a CPU-only build logs a warning per CUDA kernel library it cannot load (none of which this package
uses), and torch a deprecation about torchao's pytree registrations: both are held back, so that every rank's log
stays readable.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType


def import_torchao(module: str, *, needed_for: str, extra: str, without: str) -> ModuleType:
    """``module`` (a torchao module), or an ``ImportError`` saying that ``needed_for`` needs it, the extra that
    installs it and the setting ``without`` that does without it."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{needed_for}; install it with `pip install 'lightning-megatron[{extra}]'` "
                          f"(torchao>=0.18), or set {without}.") from error
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
