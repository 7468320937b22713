import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = pathlib.Path(os.environ.get("NGRAMSPEC_SHARED", ROOT.parent / "shared"))
GOLDEN = SHARED / "golden"
TRACES = SHARED / "traces"


@pytest.fixture(scope="session")
def shared_dir():
    if not SHARED.is_dir():
        pytest.fail(f"../shared not found at {SHARED} (set NGRAMSPEC_SHARED)")
    return SHARED
