"""Load a user's app (its :class:`~cyclone_mp.mux.Mux`) from an ``APP`` string.

``APP`` is ``module:attr`` (``examples.app:mux``) or ``path/to/file.py:attr``
(``./jobs.py:mux``); ``attr`` defaults to ``mux``. This is what ``cyclone-mp worker APP``
and ``cyclone-mp enqueue APP NAME`` take.

A file is loaded under the module name ``cyclone_mp_app_<stem>``: steps defined in a
module with that prefix remember their file path (see ``steps.handler_ref``), so a
child process re-imports their handlers from the same file. The file's directory goes
on ``sys.path`` so its sibling modules import. For a module name, the current
directory goes on ``sys.path`` (as ``python -m`` would do), so ``examples.app:mux``
imports from the repository root even through the console script.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import re
import sys
from typing import Any

from .errors import ConfigurationError
from .mux import Mux
from .steps import Step
from .workflow import Workflow

FILE_MODULE_PREFIX = "cyclone_mp_app_"  #: steps.py recognises handlers loaded from files by it
DEFAULT_ATTR = "mux"


def split_spec(spec: str) -> tuple[str, str]:
    """Split ``APP`` into ``(target, attr)``; ``attr`` defaults to ``"mux"``.

    Raises:
        ConfigurationError: an empty target or attribute.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigurationError("APP is empty: give module:attr or path/to/file.py:attr")
    target, sep, attr = spec.strip().rpartition(":")
    if not sep:
        target, attr = attr, DEFAULT_ATTR
    if not target or not attr:
        raise ConfigurationError(f"APP {spec!r} is malformed: give module:attr or path/to/file.py:attr")
    return target, attr


def is_file_target(target: str) -> bool:
    """True when ``target`` names a Python file rather than a module."""
    return target.endswith(".py") or os.sep in target or "/" in target


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _module_name_for(path: pathlib.Path) -> str:
    return FILE_MODULE_PREFIX + (re.sub(r"\W", "_", path.stem) or "app")


def _load_file(spec: str, target: str) -> Any:
    path = pathlib.Path(target).expanduser()
    if not path.is_file():
        raise ConfigurationError(f"cannot load APP {spec!r}: no such file {target!r}")
    path = path.resolve()
    name = _module_name_for(path)
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigurationError(f"cannot load APP {spec!r}: {target!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before exec: steps read their module's __file__ while it runs
    try:
        module_spec.loader.exec_module(module)
    except KeyboardInterrupt:
        sys.modules.pop(name, None)
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of user code is a config error
        sys.modules.pop(name, None)
        raise ConfigurationError(f"cannot load APP {spec!r}: importing {target} raised {_one_line(exc)}") from exc
    return module


def _load_module(spec: str, target: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise ConfigurationError(
                f"cannot load APP {spec!r}: no module named {exc.name!r} (run from the directory that holds it, "
                f"or give a path like path/to/file.py:attr)"
            ) from exc
        raise ConfigurationError(f"cannot load APP {spec!r}: importing {target} raised {_one_line(exc)}") from exc
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure of user code is a config error
        raise ConfigurationError(f"cannot load APP {spec!r}: importing {target} raised {_one_line(exc)}") from exc


def as_mux(obj: Any, spec: str = "") -> Mux:
    """Return ``obj`` as a Mux: a Mux as is, a Step or Workflow registered in a new one.

    Raises:
        ConfigurationError: ``obj`` is none of those.
    """
    if isinstance(obj, Mux):
        return obj
    if isinstance(obj, (Step, Workflow)):
        return Mux().register(obj)
    where = f"APP {spec!r}" if spec else "the app"
    kind = type(obj).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"  # "an int", "a str"
    raise ConfigurationError(f"{where} is {article} {kind}, not a cy.Mux, cy.step or cy.Workflow")


def load_app(spec: str) -> Mux:
    """Import ``APP`` and return its mux.

    Args:
        spec: ``module:attr`` or ``path/to/file.py:attr`` (``attr`` defaults to ``mux``;
            dots in ``attr`` walk attributes).

    Returns:
        The Mux (a Step or Workflow is wrapped in a new Mux).

    Raises:
        ConfigurationError: with one line naming the APP and what failed (the module
            or file does not import, the attribute is missing, or it is not a mux).
    """
    target, attr = split_spec(spec)
    module = _load_file(spec, target) if is_file_target(target) else _load_module(spec, target)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigurationError(f"cannot load APP {spec!r}: {target} has no attribute {attr!r}") from None
    return as_mux(obj, spec)
