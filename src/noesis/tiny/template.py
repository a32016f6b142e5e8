"""The jinja chat template of noesis-tiny: OpenAI-style messages and tools to Harmony text.

It must render exactly what harmony.render does (a test checks this on the corpus). Every tag strips
the whitespace around it and all output comes from expressions, so the result is the same with or
without `trim_blocks`/`lstrip_blocks`. Tool-call arguments given as a string are copied verbatim;
a dict goes through `tojson`, whose spacing depends on the renderer, so pass strings to be exact.
Encode it through `Tokenizer.encode_chat`, never by encoding the text: only then do the control
spellings inside messages, names and arguments stay text.
"""

from __future__ import annotations

from noesis.tiny.harmony import SYSTEM_PROMPT, TOOLS_NOTE


def _jinja_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_BODY = r"""
{%- macro content_text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}

{%- macro ts_type(spec) -%}
  {%- if spec['enum'] is defined -%}
    {%- for value in spec['enum'] -%}
      {{- '"' ~ value ~ '"' -}}{{- '' if loop.last else ' | ' -}}
    {%- endfor -%}
  {%- elif spec['type'] in ['number', 'integer'] -%}{{- 'number' -}}
  {%- elif spec['type'] in ['string', 'boolean'] -%}{{- spec['type'] -}}
  {%- elif spec['type'] == 'array' -%}
    {{- ts_type(spec['items'] if spec['items'] is defined else {}) ~ '[]' -}}
  {%- else -%}{{- 'any' -}}
  {%- endif -%}
{%- endmacro -%}

{%- macro ts_tool(tool) -%}
  {%- set fn = tool['function'] if tool['function'] is defined else tool -%}
  {%- if fn['description'] -%}{{- '// ' ~ fn['description'] ~ '\n' -}}{%- endif -%}
  {%- set params = fn['parameters'] if fn['parameters'] is defined else {} -%}
  {%- set props = params['properties'] if params['properties'] is defined else {} -%}
  {%- if not props -%}
    {{- 'type ' ~ fn['name'] ~ ' = () => any;' -}}
  {%- else -%}
    {%- set required = params['required'] if params['required'] is defined else [] -%}
    {{- 'type ' ~ fn['name'] ~ ' = (_: {\n' -}}
    {%- for name, spec in props.items() -%}
      {%- if spec['description'] -%}{{- '// ' ~ spec['description'] ~ '\n' -}}{%- endif -%}
      {{- name ~ ('' if name in required else '?') ~ ': ' ~ ts_type(spec) ~ ',' -}}
      {%- if spec['default'] is defined -%}{{- ' // default: ' ~ spec['default'] -}}{%- endif -%}
      {{- '\n' -}}
    {%- endfor -%}
    {{- '}) => any;' -}}
  {%- endif -%}
{%- endmacro -%}

{{- '<|start|>system<|message|>' ~ system_prompt ~ (tools_note if tools else '') ~ '<|end|>' -}}

{%- set ns = namespace(first=0, instructions='', last_call='') -%}
{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}
  {%- set ns.instructions = content_text(messages[0]['content']) -%}
  {%- set ns.first = 1 -%}
{%- endif -%}

{%- if ns.instructions or tools -%}
  {{- '<|start|>developer<|message|>' -}}
  {%- if ns.instructions -%}{{- '# Instructions\n\n' ~ ns.instructions -}}{%- endif -%}
  {%- if ns.instructions and tools -%}{{- '\n\n' -}}{%- endif -%}
  {%- if tools -%}
    {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
    {%- for tool in tools -%}{{- ts_tool(tool) ~ '\n\n' -}}{%- endfor -%}
    {{- '} // namespace functions' -}}
  {%- endif -%}
  {{- '<|end|>' -}}
{%- endif -%}

{%- for message in messages[ns.first:] -%}
  {%- if message['role'] == 'user' -%}
    {{- '<|start|>user<|message|>' ~ content_text(message['content']) ~ '<|end|>' -}}
  {%- elif message['role'] == 'assistant' -%}
    {%- if message['thinking'] -%}
      {{- '<|start|>assistant<|channel|>analysis<|message|>' ~ message['thinking'] ~ '<|end|>' -}}
    {%- endif -%}
    {%- if message['tool_calls'] -%}
      {%- for call in message['tool_calls'] -%}
        {%- set fn = call['function'] if call['function'] is defined else call -%}
        {{- '<|start|>assistant<|channel|>commentary to=functions.' ~ fn['name'] -}}
        {{- ' <|constrain|>json<|message|>' -}}
        {%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}
        {%- else -%}{{- fn['arguments'] | tojson -}}
        {%- endif -%}
        {{- '<|call|>' -}}
        {%- set ns.last_call = fn['name'] -%}
      {%- endfor -%}
    {%- else -%}
      {%- set closing = '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' -%}
      {{- '<|start|>assistant<|channel|>final<|message|>' -}}
      {{- content_text(message['content']) ~ closing -}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set name = message['name'] if message['name'] else ns.last_call -%}
    {{- '<|start|>functions.' ~ name ~ ' to=assistant<|channel|>commentary<|message|>' -}}
    {{- content_text(message['content']) ~ '<|end|>' -}}
  {%- else -%}
    {{- raise_exception('unexpected ' ~ message['role'] ~ ' message after the first message') -}}
  {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""

CHAT_TEMPLATE = (
    "{#- noesis-tiny: OpenAI-style messages and tools to Harmony (gpt-oss layout). -#}\n"
    f"{{%- set system_prompt = {_jinja_string(SYSTEM_PROMPT)} -%}}\n"
    f"{{%- set tools_note = {_jinja_string(TOOLS_NOTE)} -%}}"
    f"{_BODY.rstrip()}\n"
)
