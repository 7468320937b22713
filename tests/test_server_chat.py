"""``/v1/chat/completions`` with the GGUF's chat template (the session's live server,
`servertools`)."""
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servertools import CHAT_REPEAT, greedy  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    from ngramspec.llama.model import default_model_path
    return llama_cpp.Llama(default_model_path(), vocab_only=True, verbose=False)


def test_chat_uses_the_gguf_template(client, http, vocab):
    from ngramspec.llama import render_chat
    res = client.chat.completions.create(model="m", messages=CHAT_REPEAT, max_tokens=12,
                                         temperature=0)
    msg = res.choices[0].message
    assert msg.role == "assistant" and msg.content
    # The same prompt rendered with the GGUF's template, sent as plain text, gives the same text.
    rendered = render_chat(vocab, CHAT_REPEAT)
    assert "<|im_start|>user\nRepeat exactly" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert greedy(http, rendered, max_tokens=12)["choices"][0]["text"] == msg.content
    # Content as a list of text parts is the same message.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Repeat exactly: "},
                                          {"type": "text", "text": "the cat sat on the mat."}]}]
    again = client.chat.completions.create(model="m", messages=parts, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == msg.content
