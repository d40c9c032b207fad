"""The OpenAI request bodies we accept, validated at the HTTP edge and nowhere else.

Strict types (a string is not a number here), ranges checked with messages that name the field,
and unknown fields ignored, as vLLM does, so newer SDKs keep working. Routes turn these into
native objects (`SamplingParams`, chat messages) at once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from metrale.engine.watchdog import DEFAULT_MIN_REPEATS
from metrale.sampling_params import SamplingParams

TokenIds = list[Annotated[int, Field(ge=0)]]

# Caps on the lists a request can make the server loop over (OpenAI's own where it has one).
MAX_STOP_SEQUENCES = 16
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_TOOLS = 128
MAX_N = 128
# What a chat template is called with; `chat_template_kwargs` cannot override these.
TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "documents"}
)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Open(_Body):
    """A body part whose unknown fields are kept (a tool's `strict`, a schema's extras)."""

    model_config = ConfigDict(strict=True, extra="allow")


def _as_given(part: BaseModel) -> dict[str, Any]:
    """A checked part as the dict the client sent: what templates and grammars read."""
    return part.model_dump(exclude_unset=True)


class FunctionDefinition(_Open):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def _tool_dict(tool: FunctionTool) -> dict[str, Any]:
    return {**_as_given(tool), "type": "function"}


class NamedFunction(_Body):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Open):
    name: str | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _response_format_dict(value: ResponseFormat) -> dict[str, Any]:
    out: dict[str, Any] = {"type": value.type}
    if value.json_schema is not None:
        out["json_schema"] = value.json_schema.model_dump(exclude_unset=True, by_alias=True)
    return out


class StructuredOutputsSpec(_Body):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex or an EBNF grammar."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    grammar: str | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputsSpec:
        if sum(v is not None for v in (self.json_, self.regex, self.grammar)) != 1:
            raise ValueError("structured_outputs: give one of json (a schema), regex or grammar")
        return self


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(TEMPLATE_ARGUMENTS.intersection(value or {}))
    if reserved:
        raise ValueError(
            f"{', '.join(reserved)} cannot be set through chat_template_kwargs (use the "
            f"request's own fields)"
        )
    return value


class StreamOptions(_Body):
    include_usage: bool = False


class ExtraSamplingFields(_Body):
    """Sampling knobs past each API's own, accepted on every API's body (chat, completions,
    messages, responses) under the names vLLM's and llama.cpp's servers give them. None leaves
    the default in force: a recipe's preset, else the engine's (off)."""

    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    # the penalties see only the last this many tokens (llama.cpp's repeat_last_n); 0: all
    repetition_penalty_window: Annotated[int, Field(ge=0)] | None = None
    # llama.cpp's truncation samplers (runner/truncation.py)
    top_n_sigma: float | None = None  # <= 0: off
    typical_p: Annotated[float, Field(gt=0, le=1)] | None = None
    xtc_threshold: Annotated[float, Field(ge=0, le=1)] | None = None
    xtc_probability: Annotated[float, Field(ge=0, le=1)] | None = None
    # DRY and the LZ penalty (runner/repeat_penalties.py)
    dry_multiplier: Annotated[float, Field(ge=0)] | None = None  # 0: off
    dry_base: Annotated[float, Field(ge=1)] | None = None
    dry_allowed_length: Annotated[int, Field(ge=0)] | None = None
    dry_penalty_last_n: Annotated[int, Field(ge=-1)] | None = None  # -1: all; 0: off
    dry_sequence_breakers: (
        Annotated[
            list[Annotated[str, Field(min_length=1)]],
            Field(max_length=SamplingParams.MAX_DRY_BREAKERS),
        ]
        | None
    ) = None
    lz_penalty: Annotated[float, Field(ge=0)] | None = None  # 0: off

    def extra_sampling_fields(self) -> dict[str, Any]:
        """The fields this request set, to pass on as they are."""
        return {
            name: value
            for name in ExtraSamplingFields.model_fields
            if (value := getattr(self, name)) is not None
        }


class SamplingFields(ExtraSamplingFields):
    """Sampling knobs shared by chat and completions (OpenAI's, plus vLLM's extras)."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)
        ]
        | None
    ) = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's: lower is served first, under --scheduler priority
    # the content-loop watchdog for this request (default: the server's --content-loop-watchdog)
    content_loop_watchdog: bool | None = None
    content_loop_min_repeats: Annotated[int, Field(ge=2, le=1000)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any],
        loop_watchdog: tuple[bool, int] = (False, DEFAULT_MIN_REPEATS),
    ) -> SamplingParams:
        """The engine's parameters; the defaults (a recipe's preset, generation_config.json's)
        fill the sampling knobs the request left out,
        the server's content-loop watchdog (on, repeats) what it did not say of the watchdog."""
        watchdog_on = (
            loop_watchdog[0] if self.content_loop_watchdog is None else self.content_loop_watchdog
        )
        repeats = self.content_loop_min_repeats or loop_watchdog[1]
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                message = "logit_bias keys must be token ids (integers written as strings)"
                raise ValueError(message) from None
        chosen = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "top_k": None if self.top_k is None else max(self.top_k, 0),
        }
        chosen = {k: v for k, v in chosen.items() if v is not None} | self.extra_sampling_fields()
        return SamplingParams(
            **{**defaults, **chosen},
            n=1,
            seed=self.seed,
            logit_bias=logit_bias,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            content_loop_min_repeats=repeats if watchdog_on else 0,
        )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ContentPart(_Body):
    """Any typed content part; only text is served today, others are refused by the route."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # models' history may carry malformed JSON: kept


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role not in ("assistant",):
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Checked as typed parts, then kept as the dicts the client sent (templates read those).
    tools: (
        Annotated[
            list[Annotated[FunctionTool, AfterValidator(_tool_dict)]],
            Field(max_length=MAX_TOOLS),
        ]
        | None
    ) = None
    tool_choice: (
        Literal["none", "auto", "required"]
        | Annotated[NamedToolChoice, AfterValidator(_as_given)]
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    # tokens of prose after a call that end the turn; 0: no bound (default: the server's
    # --max-inter-tool-prose)
    max_inter_tool_prose: Annotated[int, Field(ge=0)] | None = None
    store: bool = False
    metadata: dict[str, str] | None = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    response_format: Annotated[ResponseFormat, AfterValidator(_response_format_dict)] | None = None
    structured_outputs: (
        Annotated[
            StructuredOutputsSpec,
            AfterValidator(lambda spec: spec.model_dump(exclude_none=True, by_alias=True)),
        ]
        | None
    ) = None  # vLLM's: {json | regex | grammar: ...}
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            # As in vLLM: continuing a message and opening a new turn contradict each other.
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be "
                "true; set add_generation_prompt to false"
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: object) -> object:
        if (
            value == []
            or value == ""
            or (isinstance(value, list) and any(p == [] or p == "" for p in value))
        ):
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo together with logprobs is not supported yet (no prompt "
                "logprobs); drop one of them"
            )
        return self


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
