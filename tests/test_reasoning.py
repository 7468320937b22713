"""``--reasoning-format deepseek``'s splitter (`ngramspec.server.reasoning`): llama.cpp's
reasoning parse of a chat output, and a stream cut anywhere gives the same split."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec.server.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    # (output, reasoning_content, content), as llama.cpp's try_parse_reasoning gives them
    ("<think>a b</think>  answer", "a b", "answer"),
    ("  <think>\n x \n</think>\nans<think>y</think>", "x", "ans<think>y</think>"),
    ("hello <think>x</think>", None, "hello <think>x</think>"),      # not at the start
    ("<think> still thinking  ", "still thinking", ""),              # unclosed: reasoning
    ("<think>x</thin", "x</thin", ""),
    ("<think>  </think>  42", None, "42"),                            # empty reasoning
    ("<thi", None, "<thi"),
    ("   ", None, "   "),
    ("plain answer", None, "plain answer"),
]


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_split_as_llama_cpp(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


def _streamed(text, cuts):
    sp = ReasoningSplitter()
    reasoning = content = ""
    bounds = sorted(set(c % (len(text) + 1) for c in cuts)) + [len(text)]
    start = 0
    for end in bounds:
        r, c = sp.push(text[start:end])
        reasoning, content, start = reasoning + r, content + c, end
    r, c = sp.finish()
    return (reasoning + r) or None, content + c


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", " ", "\n", "x", "yz",
                                 "</", ">"]), max_size=12),
       st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_cut_anywhere_splits_as_the_whole_text(parts, cuts):
    text = "".join(parts)
    assert _streamed(text, cuts) == split_reasoning(text)
    reasoning, content = split_reasoning(text)
    if not text.lstrip().startswith("<think>"):
        assert (reasoning, content) == (None, text)     # never touched


def test_every_piece_is_released_once_it_is_decided():
    sp = ReasoningSplitter()
    assert sp.push("<think>") == ("", "")
    assert sp.push("plan: copy") == ("plan: copy", "")
    assert sp.push(" the file</th") == (" the file", "")     # a possible tag is held
    assert sp.push("ink>\n\ndone") == ("", "done")
    assert sp.finish() == ("", "")
