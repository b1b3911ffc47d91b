"""The request bodies the server accepts: OpenAI's shapes, vLLM's extensions to them, and ours.

Unknown fields are refused (a typo must not pass silently as a default). Ours, per request: `proposer`
(who drafts: one of the bundle's kinds), `num_speculative_tokens` (γ: a compiled one, "auto", or 0 for
plain decoding), `p_min` (the draft model's confidence threshold) and `sampling_rule` (coupled or
rejection, core/request.py).

Structured output (core/grammar.py), one way per request: OpenAI's `response_format` (json_object, or
json_schema with its schema), vLLM's `structured_outputs` (json, regex, choice, grammar, json_object)
or its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class Sampling(BaseModel):
    """What both routes take."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension: 0 or -1 turn it off
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's: end like EOS (the token is kept in the tokens)
    ignore_eos: bool = False  # vLLM's: go on past EOS
    # the logits processors (core/processors.py): OpenAI's, then vLLM's
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N)  # samples of each prompt (choices prompt 0's first, as OpenAI orders them)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # ours: speculation per request
    proposer: str | None = None
    num_speculative_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    p_min: float | None = Field(None, ge=0.0, le=1.0)
    sampling_rule: Literal["coupled", "rejection"] | None = None
    # structured output
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> dict:
        """The runtime's constraint arguments (json_schema, json_object, regex, choice or grammar): {} for none."""
        asked = {}
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.json_schema
            asked["response_format"] = {"json_schema": schema.json_schema} if schema else {"json_object": True}
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(exclude_none=True)
            asked["structured_outputs"] = given
        guided = {key: value for key, value in (("json_schema", self.guided_json), ("regex", self.guided_regex),
                                                 ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if value is not None}
        if guided:
            asked["guided_*"] = guided
        if len(asked) > 1:
            raise ValueError(f"give one of {' and '.join(asked)}, not both")
        return next(iter(asked.values()), {})

    @model_validator(mode="after")
    def _one_constraint(self):
        self.constraint()
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        return max(value, 0)


class CompletionRequest(Sampling):
    # one prompt (text or token ids) or a batch of them
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default; null: what the context has left; 0: echo only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's, and this many top tokens'
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
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
