"""Built-in chat templates for GGUF files that carry none, keyed by transformers' ``model_type``.

llama.cpp does the same: it prefers the GGUF's ``tokenizer.chat_template`` and falls back to a template it knows for
the model family. A template here renders identically through transformers' ``apply_chat_template`` and the engine's
``EngineTokenizer.apply_chat_template`` (jinja2 sandbox, ``trim_blocks`` and ``lstrip_blocks``): every tag strips
the whitespace around it, so only the expressions reach the output.
"""
from __future__ import annotations

#: model_type -> jinja chat template.
CHAT_TEMPLATES: dict[str, str] = {}


def register_chat_template(template: str, *model_types: str) -> str:
    """Register ``template`` as the built-in chat template of each of ``model_types``; return it."""
    if not model_types:
        raise ValueError("register_chat_template needs at least one model_type")
    for model_type in model_types:
        if model_type in CHAT_TEMPLATES:
            raise ValueError(f"model_type '{model_type}' already has a built-in chat template")
        CHAT_TEMPLATES[model_type] = template
    return template


def builtin_chat_template(model_type: str) -> str | None:
    """The built-in chat template of ``model_type``, or None when there is none (see ``CHAT_TEMPLATES``)."""
    return CHAT_TEMPLATES.get(model_type)


# Gemma's turn format (ai.google.dev/gemma/docs/core/prompt-structure): the assistant's role is called "model", and
# there is no system role: a system message goes, followed by a blank line, in front of the first user turn, as
# Google's own template does. Turn contents are trimmed, as there; roles must alternate user/model.
GEMMA3 = register_chat_template(
    r"""{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception('Gemma roles must alternate user/assistant after an optional system message') -}}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') -}}
    {%- if message['content'] is string -%}
        {{- message['content'] | trim -}}
    {%- else -%}
        {%- for part in message['content'] if part['type'] == 'text' -%}
            {{- part['text'] | trim -}}
        {%- endfor -%}
    {%- endif -%}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
""",
    "gemma3",
    "gemma3_text",
)
