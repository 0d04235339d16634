"""The completions API's messages, as pydantic models (the place vLLM's protocol.py holds): the request with its
field rules, and the bodies the server answers with (a completion, a streamed chunk, an error), serialised by
pydantic's core. A request that breaks a rule is refused naming its field (OpenAI's `param`) and the rule in the
API's words (each field's description: `refusal`); checks that need the server (the model's name, its loop, its
stream slots) or read two fields together are api.py's.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rpt.data.text import not_utf8_at, shown

MAX_TOKENS = 10_000_000  # one stream's most new tokens: its memory does not grow, only its time
MAX_STOP = 4  # stop strings a request may give (as OpenAI's API)
MAX_N = 128  # choices per prompt
MAX_TOP_K = 1 << 30
# fields of OpenAI's completions API that rpt serve takes only at their defaults
UNSUPPORTED = {"logprobs": (None,), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}

Text = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    """No coercion ("true" is not true, 1.0 is not an integer) and no field the API does not name."""
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="true or false")
    continuous_usage_stats: bool = Field(False, description="true or false")  # vLLM's: usage in every chunk


class CompletionRequest(Strict):
    """POST /v1/completions. A null is the field's default. rpt's own fields: top_k, depth, exit, ignore_eos."""
    model: Optional[str] = Field(None, description="the served model's name")
    prompt: Union[Text, Annotated[list[Text], Field(min_length=1)]] = Field(
        description="a string or a non-empty list of strings, each at least one character")
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS, description=f"an integer from 1 to {MAX_TOKENS:,}")
    temperature: float = Field(1.0, ge=0, le=2, description="a number in [0, 2]")
    top_p: float = Field(1.0, gt=0, le=1, description="a number in (0, 1]")
    n: int = Field(1, ge=1, le=MAX_N, description=f"an integer from 1 to {MAX_N}")
    stream: bool = Field(False, description="true or false")
    stream_options: Optional[StreamOptions] = Field(
        None, description="an object of include_usage and continuous_usage_stats only")
    stop: Union[Text, Annotated[list[Text], Field(max_length=MAX_STOP)], None] = Field(
        None, description=f"a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 63, description="an integer from 0 to 2**63 - 1")
    user: Optional[str] = Field(None, description="a string")
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K,
                       description=f"0 or -1 for no limit, or an integer from 1 to {MAX_TOP_K:,}")
    depth: Optional[int] = Field(None, ge=1, description="an integer from 1 to the model's most iterations")
    exit: Optional[str] = Field(None, description='a string "CRITERION:THRESHOLD", e.g. "kl:5e-4"')
    ignore_eos: bool = Field(False, description="true or false")
    logprobs: object = None
    echo: object = None
    suffix: object = None
    best_of: object = None
    presence_penalty: object = None
    frequency_penalty: object = None
    logit_bias: object = None

    @field_validator("max_tokens", "temperature", "top_p", "n", "top_k", mode="before")
    @classmethod
    def _null_is_the_default(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _at_its_default(cls, value, info):
        if value not in UNSUPPORTED[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by rpt serve")
        return value

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def refusal(error: ValidationError) -> tuple[str, Optional[str]]:
    """The message and the field (`param`) of a request's first broken rule."""
    errors = error.errors(include_url=False)
    # a union's members each report; a string that is not Unicode text (a lone surrogate, "\ud83d" without its
    # pair, which the tokenizer could not take) is the one to name
    first = next((e for e in errors if e["type"] == "string_unicode"), errors[0])
    kind, names = first["type"], [p for p in first["loc"] if isinstance(p, str)]
    if kind == "json_invalid":
        return f"the body is not valid JSON: {first['ctx'].get('error', first['msg'])}", None
    if not names:
        return "the body must be a JSON object", None
    model, param = CompletionRequest, names[0]
    if param == "stream_options" and len(names) > 1 and kind != "extra_forbidden":
        model, param = StreamOptions, f"stream_options.{names[1]}"
    field = names[-1] if model is StreamOptions else param
    if kind == "extra_forbidden":
        if len(names) > 1:  # inside stream_options
            return "stream_options takes include_usage and continuous_usage_stats only", "stream_options"
        return f"unknown field {param!r}: this server takes {', '.join(sorted(CompletionRequest.model_fields))}", param
    if kind == "value_error":
        return str(first["ctx"]["error"]), param
    if kind == "string_unicode":
        at = not_utf8_at(first["input"])
        return (f"{param} is not valid Unicode text: character {at + 1} is {shown(first['input'][at])}; send UTF-8 "
                "text (a surrogate pair's two halves together)"), param
    return f"{param} must be {model.model_fields[field].description} (got {reprlib.repr(first['input'])})", param


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Choice(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    """A whole answer, or one chunk of a streamed one (OpenAI's chunks have the same shape)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Optional[Usage] = None

    def dumped(self) -> str:
        """As JSON, `usage` left out where it is None (a chunk without continuous usage; a serialiser of the
        model's own doubled the cost of a chunk)."""
        return self.model_dump_json(exclude=None if self.usage is not None else {"usage"})


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rpt"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
