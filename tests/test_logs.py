"""Request-log readers of ``ngramspec tune``: chat logs, text pairs, trace files, errors.

The round trips start from the recorded traces, whose prompts were built with the embedded
model's chat template (../shared/traces/README.md): each trace is turned back into text, written
as a log, read with the embedded model's tokenizer, and must give the very same token ids.
"""
import gzip
import json
import re

import numpy as np
import pytest

from ngramspec.llama.tokenizer import Tokenizer
from ngramspec.logs import detect_format, parse_chat_record, read_log, read_logs
from ngramspec.traces import TraceError, read_requests

from conftest import TRACES

llama_cpp = pytest.importorskip("llama_cpp")
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer()


def _text(tok, ids):
    return tok.text(ids, special=True)


def _messages(tok, prompt):
    """The messages of a trace prompt rendered with the ChatML template of SmolLM2."""
    text = _text(tok, prompt)
    assert text.endswith("<|im_start|>assistant\n")
    found = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", text, flags=re.S)
    assert "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in found) \
        + "<|im_start|>assistant\n" == text
    return [{"role": r, "content": c} for r, c in found]


def _write(path, objs):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for obj in objs:
            f.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    return str(path)


@pytest.mark.parametrize("family", ["code-edit", "chat"])
def test_chat_log_round_trips_the_traces(tmp_path, tokenizer, family):
    traces = read_requests(str(TRACES / f"{family}.jsonl.gz"), 6)
    plain, proxy = [], []
    for r in traces:
        messages = _messages(tokenizer, r.prompt)
        if messages[0] == {"role": "system", "content": DEFAULT_SYSTEM}:
            messages = messages[1:]      # the template puts its default system message back
        reply = _text(tokenizer, r.output)
        # the fine-tuning / server-log shape: the reply is the last message
        plain.append({"id": r.id, "messages": messages + [{"role": "assistant",
                                                           "content": reply}]})
        # the proxy shape: request + chat completion, content as text parts
        proxy.append({"request": {"model": "m", "messages": messages},
                      "response": {"object": "chat.completion", "choices": [{
                          "index": 0, "message": {"role": "assistant", "content": [
                              {"type": "text", "text": reply[:10]},
                              {"type": "text", "text": reply[10:]}]}}]}})
    for objs, name in ((plain, "plain.jsonl"), (proxy, "proxy.jsonl.gz")):
        got = read_log(_write(tmp_path / name, objs), tokenizer=lambda: tokenizer)
        assert len(got) == len(traces)
        for g, r in zip(got, traces):
            assert g.prompt.dtype == np.int32
            np.testing.assert_array_equal(g.prompt, r.prompt)
            np.testing.assert_array_equal(g.output, r.output)
    assert detect_format(str(tmp_path / "plain.jsonl")) == "chat"


def test_text_pairs_round_trip_the_traces(tmp_path, tokenizer):
    traces = read_requests(str(TRACES / "code-edit.jsonl.gz"), 4)
    # the prompt text holds the chat markers as text: a raw prompt parses them as special tokens
    objs = [{"prompt": _text(tokenizer, r.prompt), "response": _text(tokenizer, r.output)}
            for r in traces]
    objs[1] = {"prompt": objs[1]["prompt"], "completion": objs[1]["response"]}
    got = read_log(_write(tmp_path / "pairs.jsonl", objs), tokenizer=lambda: tokenizer)
    for g, r in zip(got, traces):
        np.testing.assert_array_equal(g.prompt, r.prompt)
        np.testing.assert_array_equal(g.output, r.output)
    assert [g.extra["format"] for g in got] == ["text"] * 4


def test_trace_files_read_as_replay_reads_them(tmp_path):
    path = str(TRACES / "chat.jsonl.gz")
    got, tok = read_logs([path, path], limit=3)
    assert tok is None                   # no tokenizer for token ids
    want = read_requests(path, 3)
    assert [g.id for g in got] == [w.id for w in want] * 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.output, w.output)


def test_reply_shapes():
    msgs = [{"role": "user", "content": "hi"}]
    for obj in ({"messages": msgs, "response": "yo"},
                {"messages": msgs, "completion": {"role": "assistant", "content": "yo"}},
                {"messages": msgs, "choices": [{"message": {"role": "assistant",
                                                            "content": "yo"}}]},
                {"messages": msgs, "response": {"choices": [{"text": "yo"}]}},
                {"request": {"messages": msgs}, "response": {"choices": [
                    {"message": {"role": "assistant", "content": "yo"}}]}},
                {"messages": msgs + [{"role": "assistant", "content": "yo"}]}):
        assert parse_chat_record(obj) == ([{"role": "user", "content": "hi"}], "yo"), obj


def test_tool_calls_are_rendered_as_the_traces_render_them():
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]}
    _, text = parse_chat_record({"messages": [{"role": "user", "content": "go"}, reply]})
    assert text == '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


BAD = [
    ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant reply"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}], "response": "x"}',
     "content part 0 is not text"),
    ('{"messages": [{"content": "a"}], "response": "x"}', "'role' must be a non-empty string"),
    ('{"messages": [{"role": "user", "content": "a"}], "response": {"choices": []}}',
     "'choices' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "a"}], "response": 3}', "expected a string"),
    ('{"messages": [{"role": "user", "content": 5}], "response": "x"}',
     "'content' must be a string"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "only the assistant's reply"),
    ('{"messages": [{"role": "user", "content": "a"}], "response": ""}', "the reply is empty"),
    ('{"messages": [{"role": "user", "content": "a"}], "response": "x"', "malformed JSON"),
]


@pytest.mark.parametrize("line,message", BAD)
def test_malformed_chat_logs_name_file_and_line(tmp_path, tokenizer, line, message):
    good = '{"messages": [{"role": "user", "content": "a"}], "response": "b"}'
    path = _write(tmp_path / "log.jsonl", [good, "", line])
    with pytest.raises(TraceError, match=re.escape(f"{path}:3: ") + ".*" + re.escape(message)):
        read_log(path, tokenizer=lambda: tokenizer)


def test_malformed_text_pairs_and_formats(tmp_path, tokenizer):
    path = _write(tmp_path / "pairs.jsonl", ['{"prompt": "a", "response": "b"}',
                                             '{"prompt": "a"}'])
    with pytest.raises(TraceError, match=re.escape(f"{path}:2: missing field 'response'")):
        read_log(path, tokenizer=lambda: tokenizer)
    path = _write(tmp_path / "pairs2.jsonl", ['{"prompt": "a", "response": ["b"]}'])
    with pytest.raises(TraceError, match=re.escape(f"{path}:1: field 'response' must be a str")):
        read_log(path, tokenizer=lambda: tokenizer)
    path = _write(tmp_path / "what.jsonl", ['{"text": "a"}'])
    with pytest.raises(TraceError, match=re.escape(f"{path}:1: cannot tell the log format")):
        read_log(path)
    path = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(TraceError, match="no requests"):
        read_log(path)
    # a chat line in a file read as traces: the trace reader's own error, with the line
    path = _write(tmp_path / "mixed.jsonl", ['{"prompt": [1, 2], "output": [3]}',
                                            '{"messages": []}'])
    with pytest.raises(TraceError, match=re.escape(f"{path}:2: missing field 'prompt'")):
        read_log(path)
    with pytest.raises(ValueError, match="--format 'xml'"):
        read_log(path, fmt="xml")


def test_text_keeps_long_pieces(tokenizer):
    # token 24205 is a newline and 36 spaces (37 bytes; it occurs in the code-edit traces);
    # llama-cpp-python's detokenize returns nothing for pieces over 32 bytes
    assert tokenizer.text([637, 24205, 637]) == " '\n" + " " * 36 + " '"
    assert tokenizer.text([1, 2], special=True) == "<|im_start|><|im_end|>"
    assert tokenizer.text([1, 2]) == ""


def test_tokenizer_loads_vocabulary_only(tokenizer, tmp_path):
    assert tokenizer.llm.model_params.vocab_only
    assert tokenizer.llm.n_vocab() == 49152
    with pytest.raises(FileNotFoundError, match="--model"):
        Tokenizer(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        Tokenizer(str(bad))


def test_chat_template_errors_name_file_and_line(tmp_path):
    path = _write(tmp_path / "log.jsonl", [
        {"messages": [{"role": "user", "content": "a"}], "response": "b"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}],
         "response": "b"}])
    strict = Tokenizer()      # a template that, like many, insists on alternating roles
    strict.llm.metadata["tokenizer.chat_template"] = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]"
        "['role'] %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    with pytest.raises(TraceError, match=re.escape(f"{path}:2: the chat template rejects the "
                                                   f"messages (roles must alternate)")):
        read_log(path, tokenizer=lambda: strict)
    strict.llm.metadata["tokenizer.chat_template"] = ""
    with pytest.raises(TraceError, match=re.escape(f"{path}:1: {strict.model_path}: the model "
                                                   f"has no chat template")):
        read_log(path, tokenizer=lambda: strict)
