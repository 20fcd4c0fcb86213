"""Tool calling for the chat route: OpenAI's ``tools`` / ``tool_choice`` in, ``tool_calls`` out.

The tools reach the model through its chat template (the ``tools`` variable; ``trtinfer serve --chat-template``
gives one where the model's own has none). A call is written as the Hermes format Qwen, Hermes and trtinfer's
built-in templates use: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, parsed back into OpenAI
``tool_calls``. ``tool_choice``: ``"auto"`` (default with tools) lets the model answer or call; ``"none"`` renders no
tools and parses nothing; ``"required"`` or a named function constrains the output (a grammar, as ``response_format``)
to one or more calls of the allowed functions, their arguments valid against each function's ``parameters`` schema
(and holding only the declared parameters unless the schema sets ``additionalProperties``).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from trtinfer.serving.protocol import BadRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: the tools for the template (None: none rendered), the output format that
    forces calls (None: free text), and whether the answer is parsed for calls."""

    tools: list[dict[str, Any]] | None
    response_format: str | None  # a response_format's JSON text (GenerationConfig takes it as such)
    parse: bool


def plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None = None) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` (400s naming the parameter) and say what to do with them; ``parallel``
    (OpenAI's ``parallel_tool_calls``, default true) False makes a required call exactly one."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, None, False)
    checked = [_check_tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) < len(names):
        raise BadRequest(f"tools name a function twice: {sorted({n for n in names if names.count(n) > 1})}",
                         param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(None, None, False)
    if choice == "auto":
        return ToolPlan(checked, None, True)
    if choice == "required":
        return ToolPlan(checked, calls_format(checked, one=parallel is False), True)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in checked if t["function"]["name"] == name]
        if not chosen:
            raise BadRequest(f"tool_choice names function {name!r}, which is not among the tools {names}",
                             param="tool_choice")
        return ToolPlan(checked, calls_format(chosen, one=True), True)
    raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                     '{"name": ...}}', param="tool_choice")


def _check_tool(tool: Any, i: int) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
        raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                         '{...}}}', param=f"tools.{i}")
    name = fn.get("name")
    if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name)):
        raise BadRequest(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                         param=f"tools.{i}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                         param=f"tools.{i}.function.parameters")
    return {"type": "function", "function": {**fn, "parameters": params}}


def calls_format(tools: list[dict[str, Any]], one: bool = False) -> str:
    """A ``response_format`` grammar whose outputs are ``<tool_call>`` blocks (one, or one or more) calling
    ``tools`` with arguments valid against their schemas (llguidance's Lark with ``%json``)."""
    schemas = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "arguments": _closed(t["function"]["parameters"])},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = {**call, "x-guidance": {"whitespace_flexible": False}}
    repeat = "" if one else ' ("\\n" block)*'
    lark = (f"start: block{repeat}\n"
            f'block: "{OPEN}\\n" call "\\n{CLOSE}"\n'
            f"call: %json {json.dumps(call)}\n")
    return json.dumps({"type": "grammar", "grammar": lark})


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameters schema whose object takes no property it does not declare unless it says so (the grammar's
    arguments hold the declared parameters only, as OpenAI's strict mode)."""
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


@dataclass
class Parsed:
    """An answer split into text and calls."""

    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)


def parse(text: str) -> Parsed:
    """``text`` with its ``<tool_call>`` blocks taken out as OpenAI ``tool_calls`` (each ``{"id", "type",
    "function": {"name", "arguments"}}``, arguments as JSON text); a block that is not a JSON object with a string
    ``name`` stays text. ``content`` is the text before the first call, as written (None when there is none), what
    a stream of the same answer sends (:class:`StreamFilter`); arguments the model wrote as a string are that string
    (JSON text already), not encoded again."""
    calls, start = [], None
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": arguments}})
        start = m.start() if start is None else start
    if not calls:
        return Parsed(text)
    return Parsed(text[:start] or None, calls)


class StreamFilter:
    """A streamed answer's text deltas with tool calls held back: text goes out until ``<tool_call>`` may be
    starting; the calls come whole at the end (:meth:`finish`)."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        """The part of the answer so far that is surely not a call: what to send now."""
        self.text += delta
        at = self.text.find(OPEN)
        safe = at if at >= 0 else _safe_end(self.text)
        out = self.text[self.sent:safe]  # empty while safe has not passed what was sent
        self.sent = max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The text held back that is not a call (up to the first call; all of it when there is none: a block
        that is not a call is text), and the calls: together with what :meth:`feed` sent, :func:`parse`'s answer."""
        parsed = parse(self.text)
        end = len(parsed.content or "") if parsed.calls else len(self.text)
        rest = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return rest, parsed.calls


def _safe_end(text: str) -> int:
    """Where ``text`` may begin ``<tool_call>`` (its longest tail that is a prefix of it), else its length."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return len(text) - n
    return len(text)
