"""The OpenAI completion requests' fields: one strict definition, for the gateway and the engines alike.

Types are strict: ``"5"`` is not a number, ``1`` not a boolean, ``5.0`` not a count of tokens (a float field takes
an integer, as JSON has no other way to write ``1.0``). The limits are defined here once: at most
``MAX_STOP_STRINGS`` stop strings of 1 to ``MAX_STOP_CHARS`` characters each (each generated token is matched
against every tail of each), at most ``MAX_MESSAGES`` chat messages.

A prompt is checked by a plain Python loop (``checked_prompt``), not by pydantic's: pydantic walks a list of a
million token ids holding the GIL for most of a second, which stalls the event loop whichever thread it runs in,
while a Python loop gives the GIL back every few milliseconds. With an engine's limits in the validation context
(``MAX_PROMPTS``: the prompts it generates at once; ``KV_SLOT``: the tokens one sequence holds), a longer list of
prompts, or a longer prompt of token ids, is refused before any of its items is looked at.

What an engine adds on top depends on its configuration and model (its context, its vocabulary:
``standby.intake``). The gateway checks, with these same models, the fields it reads or rewrites of a completion it
continues across failovers (``gateway.migration``); every other field, and every other request, reaches the
engine as the client sent it. Either way a refusal is ``Invalid``: every field named with what was expected, the
first one as ``param``, answered 400 in OpenAI's error shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails
from starlette.responses import JSONResponse

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
DEFAULT_MAX_TOKENS = 16  # a completion's, as OpenAI's API (and every engine here) has it
INLINE_BODY_BYTES = 4096  # bodies up to this are validated on the event loop (well under a millisecond)
MAX_PROMPTS = "max_prompts"  # the validation context's key: how many prompts one request may hold (None: any)
KV_SLOT = "kv_slot"  # the validation context's key: how many token ids one prompt may hold (None: any)

Prompt = str | list[str] | list[int] | list[list[int]]
PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids, none empty"
TOKEN_IDS = "token ids are integers >= 0"


def checked_prompt(value: object, info: ValidationInfo) -> Prompt:
    """``value`` when it is a prompt (``PROMPT_SHAPES``) within an engine's limits in the validation context (no
    more prompts than ``MAX_PROMPTS``, no prompt of more token ids than ``KV_SLOT``: each checked before anything
    it bounds is read); ValueError saying what is wrong otherwise."""
    if type(value) is str:
        return value
    if type(value) is not list or not value:
        raise ValueError(f"expected {PROMPT_SHAPES}")
    context = info.context or {}
    if type(value[0]) is not int:
        if (limit := context.get(MAX_PROMPTS)) is not None and len(value) > limit:
            raise ValueError(f"{len(value)} prompts; this engine takes at most {limit} in one request (--max-batch)")
        if type(value[0]) is str:
            if not all(type(p) is str for p in value):
                raise ValueError(f"expected {PROMPT_SHAPES}")
            return value
    prompts = [value] if type(value[0]) is int else value
    if not all(type(p) is list and p for p in prompts):
        raise ValueError(f"expected {PROMPT_SHAPES}")
    if (slot := context.get(KV_SLOT)) is not None and (longest := max(map(len, prompts))) > slot:
        raise ValueError(f"{longest} token ids; this engine's KV slot holds {slot} tokens (--kv-cache-tokens)")
    if not all(_token_ids(p) for p in prompts):
        raise ValueError(TOKEN_IDS)
    return value


def _token_ids(ids: list) -> bool:
    return all(type(t) is int and t >= 0 for t in ids)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share; unknown fields are refused by name rather than
    silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # each choice also carries ``token_ids`` (and ``prompt_token_ids`` once)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: object) -> object:
        """Checked before pydantic walks a list, so a long one costs nothing."""
        strings = [stop] if type(stop) is str else stop if type(stop) is list else None
        if stop is not None and (
            strings is None
            or len(strings) > MAX_STOP_STRINGS
            or not all(type(s) is str and 0 < len(s) <= MAX_STOP_CHARS for s in strings)
        ):
            raise ValueError(
                f"expected a string or a list of up to {MAX_STOP_STRINGS} strings, each of 1 to {MAX_STOP_CHARS} "
                "characters"
            )
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def prompt_count(self) -> int:
        """How many sequences the request generates (what admission counts it as)."""
        return 1


class CompletionRequest(SamplingRequest):
    """The supported subset of OpenAI's ``POST /v1/completions``."""

    prompt: Annotated[Prompt, PlainValidator(checked_prompt, json_schema_input_type=Prompt)]

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a text, or the token ids of one prompt."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def prompt_count(self) -> int:
        return 1 if isinstance(self.prompt, str) or isinstance(self.prompt[0], int) else len(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingRequest):
    """The supported subset of OpenAI's ``POST /v1/chat/completions``: one choice, text messages."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)


@dataclass(frozen=True)
class Invalid:
    """A request refused for its fields: ``message`` names each with what was expected, ``param`` the first."""

    message: str
    param: str | None

    def response(self) -> JSONResponse:
        """400 in OpenAI's error shape (as an engine's every other refusal)."""
        error = {"message": self.message, "type": "invalid_request_error", "param": self.param}
        return JSONResponse({"error": error}, status_code=400)


def invalid(errors: list[ErrorDetails]) -> Invalid:
    """The refusal for pydantic's ``errors``: ``field: problem`` for each, ``body`` for the body as a whole."""
    problems = [(".".join(str(p) for p in e["loc"]) or "body", e["msg"]) for e in errors]
    return Invalid("; ".join(f"{where}: {msg}" for where, msg in problems), problems[0][0].split(".")[0])


R = TypeVar("R", bound=SamplingRequest)


def validated(
    schema: type[R], value: object, max_prompts: int | None = None, kv_slot: int | None = None
) -> R | Invalid:
    """``value`` (a JSON body, parsed) as ``schema``, with at most ``max_prompts`` prompts of at most ``kv_slot``
    token ids each; the refusal otherwise. Its cost grows with the body: run it off the event loop when the body is
    large."""
    try:
        return schema.model_validate(value, context={MAX_PROMPTS: max_prompts, KV_SLOT: kv_slot})
    except ValidationError as exc:
        return invalid(exc.errors(include_url=False, include_input=False))
