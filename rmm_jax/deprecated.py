"""Names that moved: the old import path still works for a while, with a warning that says
where the name lives now.

A module whose names moved ends with ``__getattr__ = moved(__name__, {"old": "new.module"})``
(PEP 562): ``from old.module import name`` and ``old.module.name`` then return the object of
``new.module``, after a :class:`DeprecationWarning` naming both paths, and nothing is imported
until a moved name is asked for.

>>> import warnings
>>> from rmm_jax.deprecated import moved
>>> getattr_ = moved("pkg.old", {"dumps": "json"})
>>> with warnings.catch_warnings(record=True) as w:
...     warnings.simplefilter("always")
...     import json
...     getattr_("dumps") is json.dumps, str(w[0].message)
(True, 'pkg.old.dumps moved to json.dumps: import it from there (the old path goes in a later release)')
>>> getattr_("loads")
Traceback (most recent call last):
...
AttributeError: module 'pkg.old' has no attribute 'loads'
"""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves ``names`` (name → the module it moved to) from
    their new modules, each access warning with :class:`DeprecationWarning`."""
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target = names[name]
        warnings.warn(f"{module}.{name} moved to {target}.{name}: import it from there (the old path goes in a "
                      "later release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(target), name)
    __getattr__.moved = dict(names)     # what it serves, for a reader (and tests/test_deprecated.py)
    return __getattr__


def renamed_argument(function: str, old: str, new: str, old_value: Any, new_value: Any) -> Any:
    """The value of ``function``'s argument ``new``, given by a caller under its old name
    ``old`` (``old_value``, not None) with a :class:`DeprecationWarning` that names both, or
    as ``new_value``; both given is a TypeError, as Python's for one argument given twice."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{function}() got {new}= and its old name {old}=: pass {new} only")
    warnings.warn(f"{function}({old}=...) is now {function}({new}=...): pass it as {new} (the old name goes in a "
                  "later release)", DeprecationWarning, stacklevel=3)
    return old_value


def parameter(function: str, name: str, instead: str, *, stacklevel: int = 3) -> None:
    """Warn (:class:`DeprecationWarning`) that ``function``'s parameter ``name`` is
    deprecated, saying what to do ``instead``; ``stacklevel`` 3 names the caller of the
    function that calls this."""
    warnings.warn(f"{function}({name}=...) is deprecated: {instead} (the parameter goes in a later release)",
                  DeprecationWarning, stacklevel=stacklevel)
