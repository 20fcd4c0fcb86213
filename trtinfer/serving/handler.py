"""Answering one completion or chat request: queue its prompts (and ``n`` choices) on the scheduler, then return
the whole answer or stream it as OpenAI's server-sent events (merging the choices' events as they come, cancelling
everything when the client goes away)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from trtinfer.errors import ConfigError, GrammarError, InputError, ServingError
from trtinfer.runtime.config import GenerationConfig, token_ids
from trtinfer.runtime.engine import Engine
from trtinfer.runtime.generator import GenerationResult, TokenLogprob
from trtinfer.runtime.request import Event
from trtinfer.runtime.request import Request as Submitted
from trtinfer.runtime.scheduler import Scheduler
from trtinfer.serving import protocol as P
from trtinfer.serving import tools as T

if TYPE_CHECKING:
    from trtinfer.serving.app import Service

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Streamed:
    """What one choice streamed so far, for the response or the usage chunk."""

    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    offset: int = 0  # text length so far (completions' logprobs text_offset)


async def _merged(requests: list[Submitted]) -> AsyncIterator[tuple[int, Event]]:
    """``(choice index, event)`` of every request's stream, as they come."""
    if len(requests) == 1:
        async for ev in requests[0].stream():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()  # events, errors and `done` marks
    done = object()

    async def pump(i: int, req: Submitted) -> None:
        try:
            async for ev in req.stream():
                queue.put_nowait((i, ev))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        left = len(requests)
        while left:
            i, ev = await queue.get()
            if ev is done:
                left -= 1
            elif isinstance(ev, Exception):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the body is already read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_or_gone(work: asyncio.Future[Any], request: Request, stop: Callable[[], Any]) -> bool:
    """Wait until ``work`` is done or the client disconnects, whichever comes first; True when the client left
    first (``work`` still running: ``stop()`` was called, which only asks it to end)."""
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            stop()
    return not work.done()


def log_failure(what: str, status: int, exc: BaseException) -> None:
    """Log a request that failed with HTTP ``status``: a 500 is a bug, an error with its traceback; above it (the
    server stopping or overloaded) a warning line; below it (the client's) an info line."""
    level = logging.ERROR if status == 500 else logging.WARNING if status > 500 else logging.INFO
    log.log(level, "%s failed: %s", what, exc, exc_info=exc if status == 500 else None)


class _EventStream(StreamingResponse):
    """Server-sent events that cancel their requests however the response ends (done, error, client gone)."""

    def __init__(self, body: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body, self._on_close = body, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._body.aclose()


class Handler:
    """The two generation routes over one :class:`Service`: parse, submit, then answer whole or streamed."""

    def __init__(self, service: Service) -> None:
        self.service = service

    async def handle(self, req: P.CompletionRequest | P.ChatCompletionRequest, request: Request) -> Response:
        """Serve one completion or chat request."""
        engine, scheduler = self.service.ready()
        chat = isinstance(req, P.ChatCompletionRequest)
        if req.model:
            self.service.check_model(req.model)
        P.check_unsupported(req, self.service.config.max_n)
        if extra := P.unknown_fields(req):
            log.warning("ignoring unknown request field(s) %s", extra)
        tool_plan = (T.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
                     if isinstance(req, P.ChatCompletionRequest) else T.ToolPlan(None, None, False))
        if tool_plan.response_format is not None and P.response_format_of(req) is not None:
            raise P.BadRequest("this tool_choice makes the answer a tool call; drop response_format (or use "
                               "tool_choice auto)", param="response_format")
        prompts = await run_in_threadpool(_encode, engine, req, self.service.chat_template, tool_plan.tools)
        cfgs = [P.generation_config(req, engine.generation_defaults, prompt_len=len(ids),
                                    max_seq_len=scheduler.max_seq_len,
                                    default_max_tokens=None if chat else 16,
                                    defaults_set=engine.generation_defaults_set) for ids in prompts]
        if tool_plan.response_format is not None:  # a call is required: the output is one, by grammar
            cfgs = [dataclasses.replace(c, response_format=tool_plan.response_format) for c in cfgs]
        prompt_tokens = sum(len(ids) for ids in prompts)
        if cfgs[0].num_beams > 1:
            if not scheduler.prefix_caching:  # every beam step would prefill its whole sequence again
                raise P.BadRequest("use_beam_search keeps each beam's KV through prefix caching, which this server "
                                   "runs without (--no-prefix-caching); restart it with prefix caching",
                                   param="use_beam_search")
            choices = await self._beams(scheduler, prompts, cfgs, request)
        else:
            if k := self.service.config.speculative_ngram:
                cfgs = [dataclasses.replace(c, prompt_lookup_num_tokens=k) for c in cfgs]
            # every prompt x choice queues at once or not at all (a 429 leaves nothing behind)
            try:
                # off the event loop: a response_format's grammar compiles here (and the tokenizer's llguidance form
                # is made on first use), which would stall every other stream
                submitted: list[Submitted] = await run_in_threadpool(scheduler.submit_all, [
                    (ids, cfg.for_sample(j)) for ids, cfg in zip(prompts, cfgs) for j in range(req.n)])
            except GrammarError as e:  # the field the client wrote, not the response_format it became
                field = P.format_field(req) or ("tools" if tool_plan.response_format is not None else "response_format")
                raise P.BadRequest(f"{field} is not a usable grammar: {e.reason}", param=field) from e
            if req.stream:
                opts = req.stream_options  # vLLM: continuous_usage_stats only with include_usage
                usage: Literal["last", "continuous"] | None = None if opts is None or not opts.include_usage else \
                    "continuous" if opts.continuous_usage_stats else "last"
                body = self._events(submitted, P.new_id("chatcmpl" if chat else "cmpl"), chat, prompt_tokens, usage,
                                    tool_plan.parse)
                return _EventStream(body, lambda: self._cancel(submitted))
            choices = await self._collect(submitted, cfgs[0].logprobs, request)
        if choices is None:  # the client left
            return Response(status_code=499)
        if tool_plan.parse:  # the answers' <tool_call> blocks become tool_calls
            for c in choices:
                parsed = T.parse(c.text)
                if parsed.calls:
                    c.text, c.tool_calls, c.finish_reason = parsed.content or "", parsed.calls, "tool_calls"
        return JSONResponse(P.response(chat, self.service.model_name, choices, prompt_tokens,
                                       self.service.pieces))

    @staticmethod
    async def _beams(scheduler: Scheduler, prompts: list[list[int]], cfgs: list[GenerationConfig],
                     request: Request) -> list[P.Choice] | None:
        """vLLM's ``use_beam_search``: beam search over the scheduler (its steps are requests like any other), one
        prompt after another in a worker thread; every beam a choice, best first; None when the client left."""
        from trtinfer.runtime.beam import BeamSearch

        gone_flag = threading.Event()

        def search() -> list[GenerationResult]:
            out: list[GenerationResult] = []
            for ids, cfg in zip(prompts, cfgs):
                out += BeamSearch(scheduler, [ids], cfg, drive=False, should_stop=gone_flag.is_set).run()
            return out

        work = asyncio.ensure_future(run_in_threadpool(search))
        # a client that leaves sets the flag: the search ends at its next step; its requests finish on their own
        if await _first_or_gone(work, request, gone_flag.set):
            log.info("client disconnected; beam search stopped")
            return None
        return [P.Choice(i, r.text, r.finish_reason, r.stop_reason, r.token_ids, None)
                for i, r in enumerate(work.result())]

    async def _collect(self, requests: list[Submitted], logprobs: bool, request: Request) -> list[P.Choice] | None:
        """The choices once every request is done; None when the client left first (its requests free their slots)."""
        async def collect() -> list[_Streamed]:
            out = [_Streamed() for _ in requests]
            async for i, ev in _merged(requests):
                self._add(out[i], ev)
            return out

        task = asyncio.ensure_future(collect())
        try:  # a cancelled task (cancel() only asks) has no result to read
            if await _first_or_gone(task, request, task.cancel) or task.cancelled():
                log.info("client disconnected; %d request(s) cancelled", len(requests))
                return None
        finally:
            self._cancel(requests)
        return [P.Choice(i, "".join(s.text), s.finish_reason or "length", s.stop_reason, s.token_ids,
                         s.logprobs if logprobs else None) for i, s in enumerate(task.result())]

    @staticmethod
    def _add(s: _Streamed, ev: Event) -> None:
        """Fold one event into its choice."""
        if ev.token_id is not None:
            s.token_ids.append(ev.token_id)
        if ev.text:
            s.text.append(ev.text)
        if ev.logprob is not None:
            s.logprobs.append(ev.logprob)
        if ev.finish_reason is not None:
            s.finish_reason, s.stop_reason = ev.finish_reason, ev.stop_reason

    @staticmethod
    def _cancel(requests: list[Submitted]) -> None:
        """Cancel the requests still running: their slots free at the scheduler's next step."""
        for r in requests:
            if not r.done:
                r.cancel()

    async def _events(self, requests: list[Submitted], rid: str, chat: bool, prompt_tokens: int,
                      usage: Literal["last", "continuous"] | None, tools: bool = False) -> AsyncGenerator[str, None]:
        """The SSE body: a chunk per event that carries something, the usage chunk if asked, then ``[DONE]``.

        ``usage``: None, none; ``"last"``: a last chunk with the usage (``include_usage``); ``"continuous"``: that,
        and every chunk with the usage so far (vLLM's ``continuous_usage_stats``), a chunk per token then, also for
        a token whose text is still held back (a special token, half a character): as vLLM streams a chunk per
        step, a client sees each token arrive (per-token latency, progress). The usage so far counts every
        choice's tokens, as the last chunk does (vLLM counts each choice's own), so the last chunk with choices
        carries the final usage. ``tools``: text that may be a ``<tool_call>`` is held back and the calls go as one
        ``tool_calls`` delta at the choice's end (finish reason ``"tool_calls"``).
        """
        model, created, pieces = self.service.model_name, P.now(), self.service.pieces
        states = [_Streamed() for _ in requests]
        filters = [T.StreamFilter() for _ in requests] if tools else None

        def sse(choices: list[dict[str, Any]], last: bool = False) -> str:
            so_far = P.usage(prompt_tokens, sum(len(s.token_ids) for s in states)) \
                if usage == "continuous" or last else None
            data = P.chunk(chat, rid, model, created, choices, so_far, usage is not None)
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            if chat:  # OpenAI's first chunk per choice: the role
                for i in range(len(requests)):
                    yield sse([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])
            async for i, ev in _merged(requests):
                s = states[i]
                self._add(s, ev)
                lp, text = ev.logprob, ev.text
                calls: list[dict[str, Any]] = []
                if filters is not None:
                    text = filters[i].feed(ev.text)
                    if ev.finish_reason is not None:
                        tail, calls = filters[i].finish()
                        text += tail
                if not text and lp is None and ev.finish_reason is None and usage != "continuous":
                    continue  # (a token of no text yet; with continuous usage every token gets its chunk)
                if chat:
                    delta: dict[str, Any] = {"content": text} if text else {}
                    if calls:
                        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
                    choice: dict[str, Any] = {"index": i, "delta": delta,
                                              "logprobs": None if lp is None else P.chat_logprobs([lp], pieces)}
                else:
                    choice = {"index": i, "text": text, "logprobs": None if lp is None else
                              P.completion_logprobs([lp], pieces, s.offset)}
                    s.offset += len(pieces.text(lp.token_id)) if lp is not None else 0
                choice["finish_reason"] = "tool_calls" if calls else ev.finish_reason
                if ev.finish_reason is not None:
                    choice["stop_reason"] = s.stop_reason
                yield sse([choice])
            if usage is not None:
                yield sse([], last=True)
        except Exception as e:  # noqa: BLE001 - the stream has begun: the error goes as an event, then the end
            status, message = status_of(e)
            log_failure("stream", status, e)
            yield f"data: {json.dumps(P.error_body(status, message))}\n\n"
        yield "data: [DONE]\n\n"


def _encode(engine: Engine, req: P.CompletionRequest | P.ChatCompletionRequest, template: str | None = None,
            tools: list[dict[str, Any]] | None = None) -> list[list[int]]:
    """Token ids of each prompt (a chat: one, through the served chat template, with the tools if any)."""
    tok = engine.tokenizer
    if isinstance(req, P.ChatCompletionRequest):
        try:
            return [tok.encode_chat(P.chat_messages(req), tools=tools, template=template)]
        except InputError as e:  # the template's refusal (no tools in it, a bad message) is the request's 400
            raise P.BadRequest(str(e), param="tools" if tools and "tools" in str(e) else "messages") from e
    vocab = int(engine.manifest.geometry["vocab_size"])
    try:  # a token id the vocabulary lacks (or text the tokenizer refuses) is the prompt's 400
        return [tok.encode(p) if isinstance(p, str) else token_ids(p, f"prompt {i}", vocab)
                for i, p in enumerate(P.completion_prompts(req))]
    except InputError as e:
        raise P.BadRequest(str(e), param="prompt") from e


def status_of(e: BaseException) -> tuple[int, str]:
    """HTTP status and client-facing message of an exception (a bare message for failures we did not mean)."""
    status = int(getattr(e, "status", 400)) if isinstance(e, ServingError) else \
        400 if isinstance(e, (InputError, ConfigError)) else 500
    # a 500 is a failure we did not mean: its details stay in the server's log
    return status, str(e) if status != 500 else "internal server error; the server log has the details"
