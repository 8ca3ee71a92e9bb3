"""The requests of ``kvtier serve`` (DESIGN §8a): request bodies, their checks, and
error objects; what goes back is built in ``responses``.

Nothing here knows the engine: the server (``app``) turns a checked body
into tokens and sampling settings and runs them.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from . import body_json

# -- errors -----------------------------------------------------------------------


class APIError(Exception):
    """An answer other than 200: one status and one error object, never a traceback."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # e.g. a 429's Retry-After

    def body(self, anthropic: bool = False) -> dict:
        """OpenAI's error object; Anthropic clients read the same ``error`` with ``type: error`` beside it."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"type": "error", "error": error} if anthropic else {"error": error}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported by kvtier serve", param=param, code="unsupported")


def refuse_unless(ok: bool, param: str, what: str) -> None:
    """A setting the server does not implement, given another value than the one it always uses."""
    if not ok:
        raise unsupported(param, what)


# Every generated token is checked against every stop string (``text.OutputText``), so
# their number and length bound that work; real clients send a handful of short ones.
MAX_STOPS, MAX_STOP_CHARS = 64, 1000


def checked_stops(stops: list[str], param: str) -> list[str]:
    """``stops``, or the 400 for an empty one, too many, or one too long."""
    if any(not s for s in stops):
        raise invalid(f"{param}: stop strings must not be empty", param)
    if len(stops) > MAX_STOPS:
        raise invalid(f"{param}: {len(stops)} stop strings; the limit is {MAX_STOPS}", param)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid(f"{param}: a stop string is longer than {MAX_STOP_CHARS} characters", param)
    return stops


# -- request bodies ---------------------------------------------------------------


class _Body(BaseModel):
    # Strict: a string is not a number, a number is not a string. A field the server does
    # not know is a 400 that names it, never silently ignored: a setting that changes the
    # answer must not be dropped. Fields that change nothing here (user, metadata, ...)
    # are declared, and ignored on purpose.
    model_config = ConfigDict(strict=True, extra="forbid")


def _text_only(*kinds: str):
    """Content parts other than ``kinds`` (images, audio, files, documents) get one clear
    line instead of pydantic's list of union failures."""

    def check(parts: Any) -> Any:
        for part in parts if isinstance(parts, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                raise PydanticCustomError(
                    "unsupported",
                    "content of type '{kind}' is not supported by kvtier serve (it takes {kinds})",
                    {"kind": kind, "kinds": ", ".join(kinds)},
                )
        return parts

    return BeforeValidator(check)


class _Request(_Body):
    """A whole request body: ``parse_body`` validates it, then ``checked`` refuses what
    pydantic's field checks cannot say (settings kvtier does not implement)."""

    # vLLM's: only requests with the same salt (and the same tenant) share cached pages
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    @abstractmethod
    def checked(self: _R) -> _R:
        """This body, or the 400 that names the first setting kvtier refuses."""


_R = TypeVar("_R", bound=_Request)


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Request):
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 64)  # mlx's random.key takes an unsigned 64-bit seed
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as text) -> added to its logit, -100..100
    # Accepted and ignored: they describe the caller, not the answer.
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # every prefix is cached here anyway
    safety_identifier: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return checked_stops(stops, "stop")

    def checked(self: _S) -> _S:
        refuse_unless(self.n == 1, "n", "more than one choice (n = 1 only)")
        self.stop_strings()
        self.token_bias()
        return self

    @abstractmethod
    def top_logprobs_count(self) -> int | None:
        """Alternatives to report with each token's log-probability (None: no log-probabilities)."""

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` by token id; its keys are token ids written as text, as OpenAI's."""
        if self.logit_bias is None:
            return None
        if not all(key.isascii() and key.isdigit() for key in self.logit_bias):  # int() refuses "²"
            raise invalid('logit_bias: keys must be token ids (e.g. "1234")', "logit_bias")
        if not all(-100 <= bias <= 100 for bias in self.logit_bias.values()):
            raise invalid("logit_bias: biases must be in [-100, 100]", "logit_bias")
        return {int(key): bias for key, bias in self.logit_bias.items()}

    def sampling(self) -> dict:
        """The settings beyond max_tokens, temperature, top_p and seed, as SamplingParams takes them
        (each request kind counts its ``top_logprobs_count`` as OpenAI defines it for that kind)."""
        return {
            "logit_bias": self.token_bias(),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logprobs": self.top_logprobs_count(),
        }

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_S = TypeVar("_S", bound=_OpenAISampling)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)  # this many alternatives with each token's log-probability
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def checked(self) -> CompletionRequest:
        if not self.prompt:
            raise invalid("prompt must not be empty", "prompt")
        refuse_unless(not self.echo, "echo", "repeating the prompt in the answer (echo)")
        refuse_unless(self.best_of in (None, 1), "best_of", "choosing among several completions (best_of = 1 only)")
        refuse_unless(not self.suffix, "suffix", "text after the insertion point (suffix)")
        return super().checked()

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class CacheControl(_Body):
    """Anthropic's cache breakpoint (``scope``, which Claude Code sends, is accepted and ignored)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None
    scope: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Body):
    """An assistant message's earlier call, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="allow")  # name, ... reach the template as they are
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, _text_only("text")] = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted and ignored: the template renders the tools as they are
    cache_control: CacheControl | None = None  # kvtier's extension: hold the whole prompt, as Anthropic's
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict | None = None
    modalities: list[str] | None = None

    def checked(self) -> ChatCompletionRequest:
        super().checked()
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs: needs logprobs: true", "top_logprobs")
        refuse_unless(
            self.response_format in (None, {"type": "text"}),
            "response_format",
            'a response format other than {"type": "text"} (JSON mode, JSON schema)',
        )
        refuse_unless(self.modalities in (None, ["text"]), "modalities", "output other than text")
        return self

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ToolUse(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: CacheControl | None = None
    # What the client's SDK sends back of a tool_use block it received: who called the
    # tool, and a toolset's name. The call is rendered from name and input alone.
    caller: dict | None = None
    toolset_name: str | None = None


class ToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str | list[TextPart], _text_only("text")] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


AnthropicBlock = Annotated[TextPart | ToolUse | ToolResult, Field(discriminator="type")]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[AnthropicBlock], _text_only("text", "tool_use", "tool_result")]


class AnthropicTool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) run on Anthropic's side
    cache_control: CacheControl | None = None
    eager_input_streaming: bool | None = None  # a streaming hint: calls stream whole here


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # accepted and ignored, as OpenAI's parallel_tool_calls


class Diagnostics(_Body):
    """Anthropic's ``diagnostics``: the response says why the cache missed (``conversations``)."""

    previous_message_id: str | None = None


class AnthropicPrompt(_Request):
    """What makes an Anthropic prompt: the Messages body and count_tokens share it."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict | None = None
    cache_control: CacheControl | None = None  # a breakpoint after the last block
    # Accepted and ignored: Claude Code sends them on every request. context_management
    # asks Anthropic to clear old tool results past a context threshold; kvtier renders
    # the whole conversation (a prompt past the context is a 400), so nothing is cleared.
    context_management: dict | None = None
    betas: list[str] | None = None
    diagnostics: Diagnostics | None = None

    def checked(self: _P) -> _P:
        refuse_unless(self.thinking in (None, {"type": "disabled"}), "thinking", "extended thinking")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise invalid('tool_choice: {"type": "tool"} needs a name', "tool_choice.name")
        return self


_P = TypeVar("_P", bound=AnthropicPrompt)


class CountTokensRequest(AnthropicPrompt):
    """``POST /v1/messages/count_tokens``."""


class MessagesRequest(AnthropicPrompt):
    """Anthropic Messages API body."""

    max_tokens: int = Field(gt=0)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, gt=0)
    stop_sequences: list[str] = Field(default_factory=list)
    stream: bool = False
    metadata: dict | None = None  # accepted and ignored, as OpenAI's user and metadata
    service_tier: str | None = None

    def checked(self) -> MessagesRequest:
        checked_stops(self.stop_sequences, "stop_sequences")
        return super().checked()


def _bodies(base: type[_Body]) -> list[type[_Body]]:
    return [cls for sub in base.__subclasses__() for cls in (sub, *_bodies(sub))]


_FIELDS = {name for body in _bodies(_Body) for name in body.model_fields}


def _field_path(loc: tuple) -> str:
    """``messages.0.content`` from pydantic's location, without its union-member tags (``str``, ``list[int]``)."""
    return ".".join(str(part) for part in loc if isinstance(part, int) or part in _FIELDS)


def parse_body(raw: bytes, model: type[_R]) -> _R:
    """A checked request body, or the 400 that says what is wrong with it (one line)."""
    try:
        data = body_json.load(raw)
    except body_json.BodyError as err:
        raise invalid(str(err), err.param) from None
    if not isinstance(data, dict):
        raise invalid("body must be a JSON object")
    try:
        return model.model_validate(data).checked()
    except ValidationError as err:
        errors = err.errors(include_url=False)
        # A field of its own that is unknown or not supported says more than a union's failures.
        first = next((e for kind in ("unsupported", "extra_forbidden") for e in errors if e["type"] == kind), errors[0])
        if first["type"] == "extra_forbidden":
            raise unsupported(
                ".".join(filter(None, (_field_path(first["loc"][:-1]), str(first["loc"][-1])))), "this field"
            ) from None
        param = _field_path(first["loc"]) or None
        raise invalid(f"{param}: {first['msg']}" if param else first["msg"], param) from None
