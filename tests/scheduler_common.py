"""What the scheduler's test modules share (``tests/test_scheduler_*.py``, one per concern):
the real embedded model (SmolLM2-135M-Instruct Q4_1, no mocks), a started 4-slot scheduler and
the prompts, each a module-scoped fixture (a module loads the model once). Small contexts and
outputs keep each module short on a loaded 2-core box.

Greedy requests decoded together must each give their plain greedy output (where they do not,
the first difference must be a float-noise tie: ``tests/greedy.py``).
"""
import pathlib

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

import ngramspec  # noqa: E402
from ngramspec.llama import Scheduler, load_model, tokenize_prompt  # noqa: E402
from ngramspec.config import SpecConfig  # noqa: E402
from ngramspec.llama.model import default_model_path  # noqa: E402

EXAMPLE = pathlib.Path(ngramspec.__file__).parent / "examples" / "code_edit_prompt.txt"
N_CTX_SLOT = 1024
COPY_TEXT = " ".join(["The quick brown fox jumps over the lazy dog."] * 6) + " The quick brown"


@pytest.fixture(scope="module")
def llm():
    return load_model(default_model_path(), n_ctx=N_CTX_SLOT, n_threads=1)


@pytest.fixture(scope="module")
def sched(llm):
    spec = SpecConfig.from_keywords("ngram-simple,ngram-mod", ngram_simple_size_n=3,
                                    ngram_simple_size_m=8, ngram_mod_n_match=8,
                                    ngram_mod_n_min=2, ngram_mod_n_max=16)
    s = Scheduler(llm, spec, n_slots=4, n_ctx=4 * N_CTX_SLOT, n_threads=1, queue_size=512)
    s.start()
    yield s
    s.stop(cancel=True, timeout=60)


@pytest.fixture(scope="module")
def prompts(llm):
    code = EXAMPLE.read_text(encoding="utf-8")
    texts = [(code, True, 32),
             ("Write a Python function that adds two numbers.", True, 32),
             ("List the planets of the solar system, one per line.", True, 48),
             ("def fib(n):\n    if n < 2:\n        return n\n", False, 16),
             ("Repeat after me: " + COPY_TEXT, True, 32)]
    return [(tokenize_prompt(llm, t, chat=chat), n) for t, chat, n in texts]
