"""The example files that ship inside the package, so that the README's examples run from a clone
or an installed package alone (the full trace corpora stay outside, in ``../shared/traces``).

* ``traces(family)``: a small sample of real token traces per family (``traces/README.md``
  names the source and licence of each), in the format `ngramspec.traces.read_requests`,
  ``ngramspec replay``, ``ngramspec tune`` and ``ngramspec cache create`` read;
* ``path(name)``: any other example file (``code_edit_prompt.txt``, ``batch.jsonl``).

From the shell, ``python -m ngramspec.examples code-edit`` prints the path of a family's sample
(all of them without an argument)::

    ngramspec replay "$(python -m ngramspec.examples code-edit)" --spec-type ngram-mod

Thread-safety: pure functions of their arguments.
"""
from __future__ import annotations

import pathlib

from ngramspec.validation import check_choice

#: The trace families of the sample, as in ``../shared/traces`` (one ``FAMILY.jsonl.gz`` each).
FAMILIES = ("code-edit", "agentic", "reasoning", "chat", "model-generated")

_HERE = pathlib.Path(__file__).resolve().parent


def path(name: str) -> str:
    """The path of the example file ``name`` (``"code_edit_prompt.txt"``, ``"batch.jsonl"``,
    ``"traces/chat.jsonl.gz"``).

    Raises
    ------
    FileNotFoundError
        No such example file: the message lists the ones there are.
    """
    found = _HERE / name
    if not found.is_file() or _HERE not in found.resolve().parents:
        there = sorted(str(p.relative_to(_HERE)) for p in _HERE.rglob("*")
                       if p.is_file() and p.suffix not in (".py", ".pyc"))
        raise FileNotFoundError(f"no example file {name!r} in {_HERE}: there are "
                                f"{', '.join(there)}")
    return str(found)


def traces(family: str) -> str:
    """The path of the packaged sample of trace family ``family`` (`FAMILIES`), a
    ``.jsonl.gz`` file for `ngramspec.traces.read_requests` and the command line.

    Raises
    ------
    OutOfRange
        ``family`` is not one of `FAMILIES`.
    """
    check_choice("family", family, FAMILIES)
    return path(f"traces/{family}.jsonl.gz")
