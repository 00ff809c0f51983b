"""What ``lightning-megatron`` prints when a command line or a config file is wrong.

Two kinds of mistakes reach the user through jsonargparse, and both would otherwise end in its words, not ours:

* a misspelled key (``--model.init_args.learnng_rate``, ``seq_lenght:`` in a YAML file): jsonargparse says the key
  is not accepted; :func:`did_you_mean` adds the closest accepted key;
* a value the model, the data module or the strategy refuses while the CLI builds them: jsonargparse wraps the
  ``ValueError`` in a union-type error, two tracebacks and a ``Namespace(...)`` dump. :func:`build_error` finds the
  error that was raised first; :func:`report_build_error` prints only its message when this project raised it
  (one line to read, with the way to see the whole traceback), and re-raises it alone otherwise.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable, NoReturn, Optional

__all__ = ["TRACEBACK_VARIABLE", "build_error", "did_you_mean", "parser_keys", "report_build_error"]

#: Set to 1 to see the full traceback of an error raised while the CLI builds the model, the data or the Trainer.
TRACEBACK_VARIABLE = "LIGHTNING_MEGATRON_TRACEBACK"

_PACKAGE_DIR = Path(__file__).resolve().parent
# jsonargparse's words for a key it does not know, with the names to look the key up among.
_CLASS_OPTION = re.compile(r"Problem with given class_path '([\w.]+)':\s*Option '(\w+)' is not accepted")
_PARSER_KEY = re.compile(r"does not accept option '([\w.]+)'|[Uu]nrecognized arguments: --([\w.]+)")


def did_you_mean(message: str, parser_keys: Iterable[str]) -> str:
    """``" Did you mean ...?"`` lines for each unknown key named in jsonargparse's ``message`` (empty if none is
    close): an ``init_args`` key against the parameters of its ``class_path``, any other key against
    ``parser_keys`` (the parser's dotted keys, e.g. ``trainer.max_steps``)."""
    hints = []
    for class_path, option in _CLASS_OPTION.findall(message):
        match = _closest(option, _init_parameters(class_path))
        if match is not None:
            hints.append(f"'{option}' is not a parameter of {class_path}: did you mean '{match}'?")
    keys = [key for key in parser_keys if not key.endswith(".help")]
    for groups in _PARSER_KEY.findall(message):
        key = next(group for group in groups if group)
        match = _closest(key, keys)
        if match is not None:
            hints.append(f"'{key}' is not an option: did you mean '{match}'?")
    return "".join(f"\n{hint}" for hint in hints)


def _closest(word: str, candidates: Iterable[str]) -> Optional[str]:
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _init_parameters(class_path: str) -> list[str]:
    """The keyword names ``class_path``'s constructor takes; none if it cannot be imported."""
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        parameters = inspect.signature(cls).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def build_error(error: BaseException) -> BaseException:
    """The error raised first: jsonargparse re-raises a constructor's error ``from`` it, once per level."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _raised_here(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is in this package."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return Path(traceback.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


def report_build_error(error: BaseException) -> NoReturn:
    """End the command over ``error``, raised while the CLI built the model, the data or the Trainer: this project's
    ``ValueError``/``RuntimeError`` as its message alone (the last thing printed, exit code 1), anything else as its
    own traceback without jsonargparse's wrappers. ``LIGHTNING_MEGATRON_TRACEBACK=1`` re-raises ``error`` as is."""
    if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
        raise error
    cause = build_error(error)
    if isinstance(cause, (ValueError, RuntimeError)) and _raised_here(cause):
        sys.stderr.flush()
        sys.stderr.write(f"(set {TRACEBACK_VARIABLE}=1 for the full traceback)\nerror: {cause}\n")
        raise SystemExit(1)
    raise cause from None


def parser_keys(parser: Any) -> list[str]:
    """The dotted keys a jsonargparse parser accepts (``trainer.max_steps``, ``model``, ...)."""
    return [action.dest for action in getattr(parser, "_actions", []) if isinstance(action.dest, str)]
