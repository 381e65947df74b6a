"""A refused request's 400 names the field, what it expects and what it got (pydantic's errors reworded)."""

import pytest
from pydantic import ValidationError

from fxrewrite.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from fxrewrite.runtime.server.validation_errors import describe_errors

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("request_type, body, param, message", [
    (ChatCompletionRequest, CHAT | {"stop": 5}, "stop", "stop: expected a string or a list of strings, got 5 (a number)"),
    (ChatCompletionRequest, CHAT | {"max_tokens": "abc"}, "max_tokens", 'max_tokens: expected an integer, got "abc" (a string)'),
    (ChatCompletionRequest, CHAT | {"temperature": [1]}, "temperature", "temperature: expected a number, got [1] (a list)"),
    (ChatCompletionRequest, CHAT | {"temperature": -1}, "temperature",
     "temperature: expected a value greater than or equal to 0, got -1 (a number)"),
    (ChatCompletionRequest, CHAT | {"temperature": float("inf")}, "temperature",  # no upper bound, still finite
     "temperature: expected a finite number, got Infinity (a number)"),
    (ChatCompletionRequest, CHAT | {"max_tokens": 2.5}, "max_tokens", "max_tokens: expected an integer, got 2.5 (a number)"),
    (ChatCompletionRequest, CHAT | {"max_tokens": 1e308}, "max_tokens",
     "max_tokens: expected an integer, got 1e+308 (a number)"),  # not a 309-digit int (a fresh user's find)
    (CompletionRequest, COMPLETION | {"max_tokens": "2"}, "max_tokens", 'max_tokens: expected an integer, got "2" (a string)'),
    (CompletionRequest, COMPLETION | {"prompt": [[1.0, 2.5]]}, "prompt", "prompt[0][1]: expected an integer, got 2.5 (a number)"),
    (ChatCompletionRequest, CHAT | {"temperature": float("nan")}, "temperature",  # fresh-8 F6
     "temperature: expected a finite number, got NaN (a number)"),
    (CompletionRequest, COMPLETION | {"top_p": float("inf")}, "top_p",
     "top_p: expected a finite number, got Infinity (a number)"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages",
     "messages[0].content: expected a string or a list of objects, got 5 (a number)"),
    (ChatCompletionRequest, CHAT | {"tool_choice": 5}, "tool_choice",
     "tool_choice: expected 'none', 'auto', 'required' or an object, got 5 (a number)"),
    # The input had one member's shape: that member's own error, at its path.
    (ChatCompletionRequest, CHAT | {"tool_choice": {"type": "function", "function": {}}}, "tool_choice",
     "tool_choice.function.name: field required"),
    (ChatCompletionRequest, CHAT | {"tools": [{"type": "function"}]}, "tools", "tools[0].function: field required"),
    (CompletionRequest, COMPLETION | {"prompt": {"a": 1}}, "prompt", "prompt: expected a string, a list of strings, "
     'a list of integers or a list of lists of integers, got {"a": 1} (an object)'),
    (CompletionRequest, COMPLETION | {"prompt": [[1, "a"]]}, "prompt", 'prompt[0][1]: expected an integer, got "a" (a string)'),
    (ChatCompletionRequest, {"model": "m", "messages": []}, "messages",  # fresh-15: pydantic's "List should ..."
     "messages: expected at least 1 item, got [] (a list)"),
    (CompletionRequest, COMPLETION | {"seed": "s", "n": 1.5}, "n",
     "n: expected an integer, got 1.5 (a number) (and 1 more problem(s))"),
    (CompletionRequest, COMPLETION | {"stop": 5, "seed": "s", "n": [1]}, "n",
     "n: expected an integer, got [1] (a list) (and 2 more problem(s))"),
])
def test_message_names_field_expectation_and_value(request_type, body, param, message):
    with pytest.raises(ValidationError) as caught:
        request_type.model_validate(body)
    errors = [dict(e, loc=("body", *e["loc"])) for e in caught.value.errors()]  # as FastAPI reports them
    assert describe_errors(errors) == (message, param)
