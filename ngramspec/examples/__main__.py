"""``python -m ngramspec.examples [FAMILY ...]``: print the path of each family's packaged trace
sample (every family without an argument), one per line, for the command line's file arguments."""
from __future__ import annotations

import sys

from ngramspec.examples import FAMILIES, traces
from ngramspec.validation import ParamError


def main(argv=None) -> int:
    families = (sys.argv[1:] if argv is None else argv) or FAMILIES
    try:
        paths = [traces(f) for f in families]
    except ParamError as exc:
        print(f"python -m ngramspec.examples: {exc}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
