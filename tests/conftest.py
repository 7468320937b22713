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


@pytest.fixture(scope="session", autouse=True)
def private_cost_cache(tmp_path_factory):
    """Calibrations made by tests (generate's auto policy calibrates at first use) go to a
    session folder, never to the user's cache; subprocesses inherit it."""
    old = os.environ.get("NGRAMSPEC_CACHE_DIR")
    os.environ["NGRAMSPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("ngramspec-cache"))
    yield
    if old is None:
        os.environ.pop("NGRAMSPEC_CACHE_DIR", None)
    else:
        os.environ["NGRAMSPEC_CACHE_DIR"] = old
