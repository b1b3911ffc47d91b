"""The request bodies the server accepts: OpenAI's shapes, vLLM's extensions to them, and ours.

Unknown fields are refused (a typo must not pass silently as a default). OpenAI's own fields are
declared here with OpenAI's defaults and ranges; every other request option is a field of
core/params.GenerationParams with a body name (vLLM's ignore_eos, min_p, min_tokens,
repetition_penalty; ours: `proposer`, `num_speculative_tokens` for γ, `p_min`, `sampling_rule`), added
to `Sampling` from there (unset: the server's default), and checked by GenerationParams itself.
GenerationParams.from_openai maps a body onto a request.

Structured output (core/grammar.py), one way per request: OpenAI's `response_format` (json_object, or
json_schema with its schema), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object)
or its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
"""

import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from speccompile.core.params import GenerationParams, openai_constraint, options_in_bodies

# OpenAI's parameters this server does not implement: refused by name, never ignored
UNSUPPORTED = ("suffix", "functions", "function_call", "audio", "modalities", "prediction", "web_search_options")
MAX_N = 16  # samples per prompt in one request
MAX_LOGPROBS = 20  # the top tokens a graph reports (bundle.TOP_LOGPROBS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(alias="schema")  # `schema` itself would shadow pydantic's own attribute
    strict: bool | None = None  # objects are closed to unlisted keys either way (core/grammar.closed_objects)


class ResponseFormat(BaseModel):
    """OpenAI's response_format."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of its fields."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict | str | None = Field(None, alias="json")  # `json` would shadow pydantic's own
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class OpenAISampling(BaseModel):
    """OpenAI's fields both routes take (the rest of Sampling comes from GenerationParams, below)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension: 0 or -1 turn it off
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    # the logits processors (core/processors.py): OpenAI's
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # samples of each prompt (choices prompt 0's first, as OpenAI orders them)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured output
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> dict:
        """The runtime's constraint arguments (json_schema, json_object, regex, choice or grammar): {} for none."""
        from speccompile.errors import SpecCompileError

        try:
            return openai_constraint(self.model_dump(by_alias=True))
        except SpecCompileError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _one_constraint(self):
        self.constraint()
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        return max(value, 0)

    def params(self, defaults: GenerationParams | None = None, chat: bool = False) -> GenerationParams:
        """The request this body asks for (its unset options: `defaults`)."""
        return GenerationParams.from_openai(self.model_dump(by_alias=True), defaults, chat)


def _from_params() -> dict:
    """The body fields GenerationParams declares that OpenAI's do not: each optional (None: the
    server's default), of the record's type, a list where the record holds a tuple."""
    hints = typing.get_type_hints(GenerationParams)
    fields = {}
    for field, meta in options_in_bodies():
        if meta.body in OpenAISampling.model_fields:
            continue
        kind = hints[field.name]
        if typing.get_origin(kind) is tuple:
            kind = list[typing.get_args(kind)[0]]
        fields[meta.body] = (kind | None, Field(None, description=meta.help))
    return fields


Sampling = create_model("Sampling", __base__=OpenAISampling, **_from_params())


class CompletionRequest(Sampling):
    # one prompt (text or token ids) or a batch of them
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default; null: what the context has left; 0: echo only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's, and this many top tokens'
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the prompt's, with this many top
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _coherent(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for nothing unless echo is set")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported (each of the n samples is returned)")
        return self

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    def prompts(self) -> list:
        """The batch: each prompt as text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other part types are named in a clear 400 (serve/chat.py)
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, for the template to render
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # null: what the context has left (vLLM's default)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None  # passed to the template; calls come back as the assistant's text
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
