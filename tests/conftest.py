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


# -- the live server of the test_server_*.py modules: one process for the session ---------------

@pytest.fixture(scope="session")
def server():
    """``ngramspec serve`` with the embedded model, an API key, 4 slots (`servertools`)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    from servertools import CTX, KEY, SLOTS, Server

    srv = Server("-c", str(CTX), "-np", str(SLOTS), "--api-key", KEY,
                 "--spec-type", "ngram-mod,ngram-simple", "--queue-size", "16")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    """The official ``openai`` client of `server`."""
    openai = pytest.importorskip("openai")
    from servertools import KEY

    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    """Raw HTTP (httpx) to `server`, with the key."""
    httpx = pytest.importorskip("httpx")
    from servertools import KEY

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as c:
        yield c
