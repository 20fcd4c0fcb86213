"""OpenAI's wire format: request models, their mapping onto :class:`GenerationConfig`, response and error bodies.

Requests are pydantic models that accept OpenAI's fields and vLLM's extra sampling fields (``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``repetition_penalty``); unknown fields are ignored with a warning, as vLLM does.
Values are checked where one rule lives: :class:`GenerationConfig` (``ConfigError.field`` is mapped back to the
request's parameter name), plus the few rules that are OpenAI's own (``n``, what is not supported); the sampling
fields are read as Triton's are (:mod:`trtinfer.serving.sampling`: ``temperature`` 0 means greedy, ...). Responses
are plain dicts shaped as OpenAI's, which the ``openai`` client parses.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from trtinfer.errors import ConfigError, InputError, ServingError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.generator import TokenLogprob
from trtinfer.serving.sampling import VLLM_FIELDS, sampling_fields

#: the most sequences (prompts x n) one request may queue (OpenAI caps a batch of inputs at 2048)
MAX_SEQUENCES = 2048
#: GenerationConfig field -> the request parameter that sets it, for error messages
PARAM_OF = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs"}
#: HTTP status -> OpenAI error type (any other: invalid_request_error, as 405 and 413 are)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class BadRequest(ServingError):
    """A request the server refuses; ``status`` is its HTTP status, ``param`` the parameter at fault."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


class _Body(BaseModel):
    # unknown fields are kept in model_extra and reported, not refused: clients send fields we do not know. Numbers
    # and flags are strict (StrictInt, ...): JSON true is not n=1, "5" is not max_tokens 5 (OpenAI refuses both)
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices; with it, vLLM's
    ``continuous_usage_stats`` puts the usage so far on every chunk too."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(_Body):
    """The fields completions and chat share. An explicit ``null`` is the field's default, as OpenAI's API types
    its optional fields (``"n": null``, ``"stream": null``, ``"logprobs": null``, ...)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    repetition_penalty: StrictFloat | None = None
    # structured outputs: OpenAI's response_format, and vLLM's guided decoding extras (one of them at a time)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search: the n best of n beams (trtinfer.runtime.beam over the server's scheduler)
    use_beam_search: StrictBool = False
    length_penalty: StrictFloat = 1.0
    early_stopping: StrictBool | Literal["never"] = False


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt (text, token ids, or a batch of either) to continue."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None


class ContentPart(_Body):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None


#: the roles OpenAI's chat API knows; any other is refused (400, ``messages.K.role``) before a template sees it
Role = Literal["system", "user", "assistant", "tool", "developer", "function"]


class ChatMessage(_Body):
    """A chat message: a role and its content (text, or text parts); an assistant's earlier ``tool_calls``, a tool
    result's ``tool_call_id``."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: a conversation rendered through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None  # OpenAI's legacy form of tools
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None


def unknown_fields(req: BaseModel) -> list[str]:
    """The request's fields this server does not know (nested ones as ``parent.child``)."""
    found = sorted(req.model_extra or {})
    for name in type(req).model_fields:
        value = getattr(req, name)
        for item in (value if isinstance(value, list) else [value]):
            if isinstance(item, _Body):
                found += [f"{name}.{k}" for k in sorted(item.model_extra or {})]
    return found


def check_unsupported(req: _Sampling, max_n: int) -> None:
    """Refuse what the server does not do, naming the parameter (OpenAI answers such requests with 400 too)."""
    if not 1 <= req.n <= max_n:
        raise BadRequest(f"n must be within 1..{max_n}, got {req.n}", param="n")
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported by this server; leave it out", param="logit_bias")
    if req.use_beam_search:
        structured = response_format_of(req) is not None
        beams_refuse = [
            ("stream", req.stream, "beam search cannot stream: the best beams are known only at the end"),
            ("stop", bool(req.stop), "beam search ends beams at EOS or the length limit, not at stop strings"),
            ("response_format", structured, "beam search does not combine with structured outputs"),
            ("logprobs", bool(getattr(req, "logprobs", None)), "beam search gives each beam's score, not logprobs"),
            ("tools", bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) != "none",
             "beam search does not make tool calls"),
        ]
        for param, bad, why in beams_refuse:
            if bad:
                raise BadRequest(f"{why}; leave {param} out with use_beam_search", param=param)
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")
    if isinstance(req, CompletionRequest):
        prompts = len(_prompt_list(req.prompt))
        if prompts * req.n > MAX_SEQUENCES:  # each queues whole: a 1 MiB body of [[1],[1],...] x n=16 was millions
            raise BadRequest(f"a request holds at most {MAX_SEQUENCES} sequences (prompts x n), got {prompts} x "
                             f"{req.n}; split it", param="prompt")
        if req.echo:
            raise BadRequest("echo is not supported by this server; prepend the prompt yourself", param="echo")
        if req.suffix:
            raise BadRequest("suffix is not supported by this server", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise BadRequest(f"best_of must equal n ({req.n}) or be left out: this server returns every choice it "
                             "generates", param="best_of")
    if isinstance(req, ChatCompletionRequest):
        if req.functions or req.function_call not in (None, "none"):
            raise BadRequest("functions/function_call (the legacy form of tools) are not served; send tools and "
                             "tool_choice", param="functions")
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as ``{"role", "content"}`` dicts of text (text parts joined by newlines, as vLLM does), with
    ``name``, ``tool_calls`` and ``tool_call_id`` where given (for the chat template)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if bad := [p.type for p in content if p.type != "text" or p.text is None]:
                raise BadRequest(f"messages[{i}].content has a {bad[0]!r} part; only text parts are supported",
                                 param=f"messages.{i}.content")
            content = "\n".join(p.text or "" for p in content)
        out.append({"role": m.role, "content": content or "",
                    **m.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)})
    return out


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """A completion's ``prompt`` (a text, token ids, or a batch of either) as a list of prompts."""
    return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: each a text or a list of token ids."""
    prompts = _prompt_list(req.prompt)
    if not prompts:
        raise BadRequest("prompt must not be empty", param="prompt")
    for i, one in enumerate(prompts):
        if len(one) == 0:
            raise BadRequest(f"prompt {i} is empty; give at least one character or token", param="prompt")
    return prompts


def generation_config(req: _Sampling, defaults: GenerationConfig, *, prompt_len: int, max_seq_len: int,
                      default_max_tokens: int | None, defaults_set: frozenset[str] = frozenset()) -> GenerationConfig:
    """The request's sampling settings over the engine's defaults (the model's generation_config.json).

    Left out: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` take the model's
    defaults (as vLLM does), and so does greedy vs sampling (``trtinfer generate``'s rule: the model's
    ``do_sample``, greedy where it says nothing); ``temperature`` 0 is greedy and > 0 samples; ``top_p``, ``top_k``
    or ``min_p`` given without ``temperature`` sample at the model's temperature. ``max_tokens`` left out is
    ``default_max_tokens`` (None: the rest of the context), capped at what the context holds. ``top_k`` applies only
    where the model's file (``defaults_set`` names the fields it set) or the request sets it, as in vLLM; not
    transformers' own default of 50.
    """
    room = max_seq_len - prompt_len
    if room < 1:
        raise BadRequest(f"this model's maximum context length is {max_seq_len} tokens, and the prompt has "
                         f"{prompt_len}: no room for a completion; shorten the prompt", param="messages"
                         if isinstance(req, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
    newer = isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
    max_param = "max_completion_tokens" if newer else "max_tokens"  # OpenAI's newer name wins where both are given
    max_tokens = getattr(req, max_param)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise BadRequest(f"this model's maximum context length is {max_seq_len} tokens; you asked for "
                         f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate); lower "
                         f"{max_param} to at most {room} or shorten the prompt", param=max_param,
                         code="context_length_exceeded")
    fields: dict[str, Any] = {
        "max_new_tokens": max_tokens, "do_sample": defaults.do_sample, "temperature": defaults.temperature,
        "top_p": defaults.top_p, "top_k": defaults.top_k if "top_k" in defaults_set else 0, "min_p": defaults.min_p,
        "repetition_penalty": defaults.repetition_penalty, "no_repeat_ngram_size": defaults.no_repeat_ngram_size,
    }
    try:
        fields.update(sampling_fields(req.model_dump(include=VLLM_FIELDS.keys() - {"max_tokens"})))
    except InputError as e:
        raise BadRequest(str(e), param="temperature") from e
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        fields["logprobs"], fields["top_logprobs"] = True, req.logprobs
    if req.use_beam_search and req.n > 1:  # vLLM: n is the beam width, and every beam is a choice
        fields.update(num_beams=req.n, num_return_sequences=req.n, do_sample=False, length_penalty=req.length_penalty,
                      early_stopping=req.early_stopping, stop=[])
    elif req.use_beam_search:  # a beam width of 1 is greedy decoding
        fields["do_sample"] = False
    if (fmt := response_format_of(req)) is not None:
        fields["response_format"] = fmt
    if isinstance(req, ChatCompletionRequest) and req.logprobs:
        fields["logprobs"], fields["top_logprobs"] = True, req.top_logprobs or 0
    try:
        return GenerationConfig(**fields)
    except ConfigError as e:
        # the parameter the client wrote (max_completion_tokens, chat's top_logprobs, guided_regex, ...)
        params = {**PARAM_OF, "max_new_tokens": max_param, "response_format": format_field(req) or "response_format"}
        if isinstance(req, ChatCompletionRequest):
            params["top_logprobs"] = "top_logprobs"
        message = str(e)
        for field, shown in PARAM_OF.items():
            message = message.replace(field, shown)
        raise BadRequest(message, param=params.get(e.field or "", e.field) or None) from e


# ------------------------------------------------------------------------------------------------------------------
# responses


def new_id(prefix: str) -> str:
    """A response id as OpenAI's: ``cmpl-...`` / ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TokenPieces(NamedTuple):
    """How logprobs show a token alone: ``text`` (special tokens shown; part of a character is U+FFFD) and ``raw``,
    its UTF-8 bytes (part of a character: those bytes, so a client joining a character's tokens gets its UTF-8)."""

    text: Callable[[int], str]
    raw: Callable[[int], bytes]


def completion_logprobs(items: Sequence[TokenLogprob], pieces: TokenPieces, offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for some tokens; ``offset`` is the text length before them."""
    tokens = [pieces.text(lp.token_id) for lp in items]
    offsets = list(itertools.accumulate(map(len, tokens), initial=offset))[:-1]
    tops = []
    for lp in items:  # keyed by text: of two tokens of the same text (say U+FFFD) the likelier one stays
        top: dict[str, float] = {}
        for alt, v in lp.top:
            top.setdefault(pieces.text(alt), v)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in items], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(items: Sequence[TokenLogprob], pieces: TokenPieces) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": pieces.text(token_id), "logprob": logprob, "bytes": list(pieces.raw(token_id))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in items], "refusal": None}


@dataclasses.dataclass
class Choice:
    """One finished choice, as the app collects it."""

    index: int
    text: str
    finish_reason: str
    stop_reason: str | int | None
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's tool_calls parsed out of ``text`` (chat with tools)


def response(chat: bool, model: str, choices: Sequence[Choice], prompt_tokens: int,
             pieces: TokenPieces) -> dict[str, Any]:
    """A whole ``chat.completion`` or ``text_completion``."""
    logprobs = chat_logprobs if chat else completion_logprobs
    return {"id": new_id("chatcmpl" if chat else "cmpl"), "object": "chat.completion" if chat else "text_completion",
            "created": now(), "model": model,
            "choices": [{"index": c.index, **({"message": _message(c)} if chat else {"text": c.text}),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                         "logprobs": None if c.logprobs is None else logprobs(c.logprobs, pieces)}
                        for c in choices],
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices))}


def _message(c: Choice) -> dict[str, Any]:
    """A choice's assistant message: its text, or its tool calls (and the text before them, or null)."""
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text}
    return {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}


def chunk(chat: bool, rid: str, model: str, created: int, choices: list[dict[str, Any]],
          usage_: dict[str, int] | None = None, with_usage: bool = False) -> dict[str, Any]:
    """One streamed chunk; ``with_usage`` adds ``"usage"`` (null but on the last chunk), as OpenAI does."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": choices, **({"usage": usage_} if with_usage else {})}


def model_card(name: str, max_seq_len: int, created: int) -> dict[str, Any]:
    """``GET /v1/models/{name}``: OpenAI's model object, plus vLLM's ``root`` and ``max_model_len``."""
    return {"id": name, "object": "model", "created": created, "owned_by": "trtinfer", "root": name,
            "max_model_len": max_seq_len}


def models_list(name: str, max_seq_len: int, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one served model."""
    return {"object": "list", "data": [model_card(name, max_seq_len, created)]}


def _formats_given(req: _Sampling) -> dict[str, Any]:
    return {name: getattr(req, name) for name in ("response_format", "guided_json", "guided_regex", "guided_choice",
                                                  "guided_grammar") if getattr(req, name) is not None}


def format_field(req: _Sampling) -> str | None:
    """The request field that asked for structured output (``response_format`` or a ``guided_*`` extra), if any."""
    return next(iter(_formats_given(req)), None)


def response_format_of(req: _Sampling) -> dict[str, Any] | None:
    """The request's structured-output format: ``response_format`` or one of vLLM's ``guided_*`` extras, as a
    ``response_format`` object (None for plain text). Two of them at once is a 400."""
    given = _formats_given(req)
    if len(given) > 1:
        raise BadRequest(f"give one of {sorted(given)}, not several", param=sorted(given)[1])
    if not given:
        return None
    (name, value), = given.items()
    if name == "response_format":
        return value  # type: ignore[no-any-return]
    if name == "guided_json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError as e:
            raise BadRequest(f"guided_json must be a JSON schema (an object or its JSON text): {e}",
                             param="guided_json") from e
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}
    kind = name.removeprefix("guided_")
    return {"type": kind, kind: value}
