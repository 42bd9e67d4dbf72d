"""Gemma's chat format as a Jinja template (:data:`GEMMA_CHAT`, the built-in ``gemma`` template): the turns of
Gemma 2 / Gemma 3's instruction-tuned models, which their ``tokenizer_config.json`` carries --

    <bos><start_of_turn>user
    {system}\\n\\n{first user message}<end_of_turn>
    <start_of_turn>model
    {reply}<end_of_turn>

-- the assistant's turns under the role ``model``, a system message folded into the first user turn (Gemma has no
system role), each message's text trimmed, ``<start_of_turn>model\\n`` as the generation prompt. Text-only (an
image item is refused). A Gemma checkpoint's own template is read from its files (:mod:`.hf_templates`); this
one is for a base model (Gemma 3 270M's GGUF file has none) to be fine-tuned or prompted in Gemma's format:
``decoderlab chat --template gemma``, ``finetune --template gemma``.

Source: Gemma Team 2025, "Gemma 3 Technical Report" (the formatting of its instruction-tuned models);
``google/gemma-3-270m-it``'s ``chat_template``.
"""

from __future__ import annotations

#: the built-in template's name
GEMMA_NAME = "gemma"
#: the tokens it writes by name (Gemma's vocabulary: <bos> is id 2)
GEMMA_TOKENS = {"bos_token": "<bos>"}
GEMMA_CHAT = r"""{#- Gemma's turns: user / model, a system message before the first user message -#}
{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set prefix = messages[0]['content'] + '\n\n' %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set prefix = '' %}
    {%- set turns = messages %}
{%- endif %}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['content'] is not string %}
        {{- raise_exception('the gemma template writes text messages only') }}
    {%- endif %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + (message['content'] | trim) }}
    {{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}"""
