"""The completions API's models (rpt/serve/protocol.py) without a server: every field's rule refuses what breaks it,
naming the field and the rule; nothing is coerced; the bodies the server writes parse as the openai client's own
types."""

import json

import pytest
from openai.types import Completion as OpenAICompletion
from pydantic import ValidationError

from rpt.serve.protocol import (Choice, CompletionRequest, CompletionResponse, ErrorDetail, ErrorResponse, ModelList,
                                ModelCard, Usage, refusal)


def refused(body) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate(body)
    return refusal(caught.value)


@pytest.mark.parametrize("field, bad, rule", [
    ("max_tokens", 0, "from 1 to"), ("max_tokens", 1.0, "integer"), ("max_tokens", True, "integer"),
    ("temperature", 2.5, "[0, 2]"), ("temperature", "1", "[0, 2]"), ("top_p", 0, "(0, 1]"),
    ("n", 129, "from 1 to 128"), ("stream", "true", "true or false"), ("stream", 1, "true or false"),
    ("stop", ["a"] * 5, "at most 4"), ("stop", "", "non-empty"), ("stop", ["a", 5], "strings"),
    ("seed", -1, "2**63"), ("seed", 2 ** 63, "2**63"), ("top_k", -2, "-1 for no limit"), ("depth", 0, "from 1"),
    ("exit", 5, "CRITERION:THRESHOLD"), ("ignore_eos", "no", "true or false"), ("user", 3, "a string"),
    ("prompt", "", "at least one character"), ("prompt", [], "non-empty list"), ("prompt", 7, "a string"),
    ("prompt", ["a", None], "strings"),
])
def test_each_field_s_rule_refuses_naming_the_field_and_the_rule(field, bad, rule):
    message, param = refused({"prompt": "a", field: bad})
    assert param == field and rule in message and message.startswith(field), message


@pytest.mark.parametrize("field, bad", [("logprobs", 1), ("echo", True), ("suffix", "x"), ("best_of", 2),
                                        ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"1": 5})])
def test_fields_taken_only_at_their_defaults(field, bad):
    assert refused({"prompt": "a", field: bad}) == (f"{field} is not supported by rpt serve", field)
    default = {"logprobs": None, "echo": False, "suffix": "", "best_of": 1, "presence_penalty": 0,
               "frequency_penalty": 0, "logit_bias": {}}[field]
    CompletionRequest.model_validate({"prompt": "a", field: default})


def test_unknown_fields_nested_rules_and_the_body_s_shape():
    message, param = refused({"prompt": "a", "colour": "red"})
    assert param == "colour" and "max_tokens" in message and "ignore_eos" in message
    assert refused({"prompt": "a", "stream_options": {"include_usage": "yes"}}) == (
        "stream_options.include_usage must be true or false (got 'yes')", "stream_options.include_usage")
    assert refused({"prompt": "a", "stream_options": {"usage": True}})[1] == "stream_options"
    assert refused([1, 2]) == ("the body must be a JSON object", None)
    message, param = refused(json.loads('{"prompt": ["fine", "ab\\ud83d"]}'))
    assert param == "prompt" and "pair" in message and "character 3" in message


def test_nulls_are_defaults_and_values_are_kept_as_given():
    req = CompletionRequest.model_validate({"prompt": ["x", "y"], "max_tokens": None, "temperature": 0, "n": None,
                                            "stop": "END", "echo": False, "best_of": 1})
    assert req.prompts == ["x", "y"] and req.stops == ("END",) and req.max_tokens == 16 and req.n == 1
    assert req.temperature == 0.0 and isinstance(req.temperature, float)  # an integer is a number
    assert CompletionRequest.model_validate({"prompt": "x", "stop": ["a", "b"]}).stops == ("a", "b")


def test_the_bodies_parse_as_the_openai_client_s_types():
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    whole = CompletionResponse(id="cmpl-1", created=7, model="tiny", usage=usage,
                               choices=[Choice(text="hi", index=0, finish_reason="length")]).dumped()
    parsed = OpenAICompletion.model_validate_json(whole)
    assert parsed.choices[0].text == "hi" and parsed.usage.total_tokens == 5 and parsed.object == "text_completion"
    chunk = json.loads(CompletionResponse(id="cmpl-1", created=7, model="tiny",
                                          choices=[Choice(text="h", index=1)]).dumped())
    assert "usage" not in chunk and chunk["choices"][0] == {"text": "h", "index": 1, "logprobs": None,
                                                            "finish_reason": None}
    error = json.loads(ErrorResponse(error=ErrorDetail(message="m", type="invalid_request_error")).model_dump_json())
    assert error == {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    listed = json.loads(ModelList(data=[ModelCard(id="tiny", created=7)]).model_dump_json())
    assert listed == {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 7, "owned_by": "rpt"}]}
