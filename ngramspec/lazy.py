"""Public names of a package that import their module on first use (PEP 562).

`ngramspec` re-exports the live drivers and `ngramspec.llama` its modules' names this way, so
importing either (the command line names them) loads neither llama_cpp nor the modules a run
does not use.

Notes
-----
Thread-safety: the import system's lock serializes the first imports; the table is read only.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Iterable, List, Tuple

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Dict[str, Iterable[str]], eager: Iterable[str] = ()
                 ) -> Tuple[List[str], Callable[[str], object], Callable[[], List[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for `package`'s lazily exported names.

    Parameters
    ----------
    package : str
        The package's ``__name__`` (relative module names are resolved against it).
    exports : dict of str to iterable of str
        Module name (absolute, or relative like ``".live"``) -> the public names it defines.
    eager : iterable of str
        The package's names imported the ordinary way, listed in ``__all__`` too.

    Returns
    -------
    tuple
        ``(__all__, __getattr__, __dir__)`` to assign at module level.
    """
    module_of = {name: module for module, names in exports.items() for name in names}
    public = sorted(set(module_of) | set(eager))

    def __getattr__(name: str):
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    def __dir__() -> List[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(public))

    return public, __getattr__, __dir__
