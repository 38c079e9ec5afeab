"""One exception tree: every exception class defined under sandgate/ descends from SandgateError.

A module that owns its exception subclasses one of errors.py's bases, and the tree drawn in
errors.py's docstring names it, so the documented tree cannot drift from the code.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import sandgate
from sandgate import errors
from sandgate.errors import SandgateError

# Exception classes that may stay outside the tree, each with its reason. Keep it empty if you
# can: a new entry needs a reason a reviewer accepts.
OUTSIDE: dict[str, str] = {}


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(sandgate.__path__, "sandgate.")
                  if not m.name.endswith(".__main__"))  # __main__ runs the CLI when imported


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined (not imported) by a module under sandgate/."""
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        mod = importlib.import_module(name)
        for _, obj in inspect.getmembers(mod, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


def test_the_walk_finds_the_exceptions() -> None:
    found = exception_classes()
    # the walk itself works: classes of the tree's own module and of modules deep in packages
    assert "sandgate.errors.Refused" in found
    assert "sandgate.rpc.jsonrpc.CallError" in found
    assert len(found) > 30


def test_every_exception_descends_from_the_root() -> None:
    outside = sorted(qual for qual, cls in exception_classes().items()
                     if not issubclass(cls, SandgateError) and qual not in OUTSIDE)
    assert outside == [], (
        "exception classes outside sandgate.errors' tree: subclass one of its bases "
        "(InvalidInput, NotVerified, Unavailable, SetupFailed, InternalError, Refused, or "
        f"SandgateError itself), or list the class in OUTSIDE with a reason: {outside}")


def test_the_allowlist_only_names_real_outsiders() -> None:
    found = exception_classes()
    stale = sorted(q for q in OUTSIDE if q not in found or issubclass(found[q], SandgateError))
    assert stale == [], f"OUTSIDE names classes that are gone or already in the tree: {stale}"


def test_the_documented_tree_names_every_class() -> None:
    doc = errors.__doc__ or ""
    missing = sorted(qual for qual, cls in exception_classes().items()
                     if issubclass(cls, SandgateError) and cls is not SandgateError
                     and f" {cls.__name__} " not in doc.replace("\n", " ")
                     and f" {cls.__name__}(" not in doc)
    assert missing == [], f"errors.py's drawn tree does not name: {missing}"


def test_input_errors_are_still_value_errors() -> None:
    # callers (and the request parser's users at load time) catch ValueError: still caught
    for cls in exception_classes().values():
        if issubclass(cls, errors.InvalidInput):
            assert issubclass(cls, ValueError), cls


def test_setup_and_internal_errors_are_still_runtime_errors() -> None:
    # `sandgate run` catches RuntimeError for Docker and the dev Vault: still caught
    for cls in exception_classes().values():
        if issubclass(cls, errors.SetupFailed | errors.InternalError):
            assert issubclass(cls, RuntimeError), cls
