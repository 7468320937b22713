"""`ngramspec.integrations.request_args`: a request's ``prediction`` and ``speculative``
objects inside an engine are refused in one way, named and worded as ``serve`` refuses them
(`ngramspec.server.errors`), whichever object failed its schema."""
import pytest

pytest.importorskip("pydantic")

from ngramspec.integrations.request_args import checked_args  # noqa: E402
from ngramspec.validation import Refused  # noqa: E402


@pytest.mark.parametrize("args, field, message", [
    ({"prediction": {"type": "content"}}, "prediction.content",
     "prediction.content: this field is required"),
    ({"prediction": {"type": "content", "content": [{"type": "text"}]}}, "prediction.content",
     "prediction.content: Input should be a valid string (got [{'type': 'text'}])"),
    ({"prediction": {"type": "file", "content": "x"}}, "prediction.type",
     "prediction.type: Input should be 'content' (got 'file')"),
    ({"speculative": {"enabled": "no"}}, "speculative.enabled",
     "speculative.enabled: Input should be a valid boolean (got 'no')"),
    ({"speculative": {"bogus": 1}}, "speculative.bogus", "speculative.bogus: unknown field"),
])
def test_schema_errors_are_named_and_worded_as_serves(args, field, message):
    with pytest.raises(Refused) as info:
        checked_args(args, tokenize=lambda text: [1])
    assert info.value.field == field and str(info.value) == message
