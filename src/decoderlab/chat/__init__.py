"""Conversations: chat templates and the one renderer, JSONL conversation data, replies, and the one loader.

One function turns a conversation into token ids plus a loss mask -- :meth:`ChatTemplate.render` (also
:func:`render_chat`) -- and it is the only renderer: fine-tuning (:func:`decoderlab.finetuning.finetune`),
``decoderlab chat``, ``decoderlab generate --chat``, ``decoderlab explain --chat``, :func:`chat_reply` /
:func:`stream_chat_reply` (and so the server) all call it, so a model sees at inference exactly the token
layout it was trained on.

- :mod:`.messages`: a conversation's shape (roles, order) and its check;
- :mod:`.templates`: ``ChatTemplate``, ``TEMPLATES`` ("decoderlab", "lesson", "tools"), ``JINJA_TEMPLATES``
  ("chatml-tools"), the stored template, the template's special tokens in a tokenizer and a model, and
  ``tools_template`` (SmolLM2's ChatML given ``chatml-tools`` when tools are asked for);
- :mod:`.jinja`: ``JinjaChatTemplate``, a Hugging Face ``chat_template`` rendered as ``transformers`` renders it,
  behind the same interface;
- :mod:`.hermes`: tool calls as text between ``<tool_call>`` and ``</tool_call>`` (Qwen2.5's, Hermes'): the
  ``chatml-tools`` template (``CHATML_TOOLS``), ``parse_hermes_calls`` (a reply back into content and calls);
- :mod:`.hf_templates`: ``chat_template_jinja`` (any template's Jinja text, for export) and
  ``read_chat_template`` (a Hugging Face directory's template);
- :mod:`.data`: JSONL files in three formats (messages, prompt-completion, Alpaca);
- :mod:`.replies`: ``stream_chat_reply`` / ``chat_reply`` and ``TemplateChatSession``;
- :mod:`.calculator`: the built-in ``calculator`` tool (a syntax-tree walker, never ``eval``) and ``TOOLS``;
- :mod:`.tool_loop`: ``run_tool_turn``, a turn that runs the tools the model calls and feeds their results back
  (in either format of calls: ``check_tool_template``), and ``run_tool_turns``, many turns with their
  generations batched;
- :mod:`.loading`: ``load_model``, the model, tokenizer, template and ``meta.json`` of a checkpoint together (a
  LoRA run's: its base, checked, with the adapter: ``load_base``); ``weights_dtype``, the dtype a checkpoint stores;
  ``checkpoint_kind``, what a path is to it (the one message for a path that is no checkpoint).

Layer: above ``generation``, ``checkpoint`` and ``hf`` (it streams replies and reads checkpoints), below
``finetuning``, the server and the CLI; it never imports Lightning.
"""

from ..checkpoint import CHAT_TEMPLATE_KEY
from .data import FORMATS, Conversations, as_conversations, check_representable, load_conversations, message_text
from .loading import LoadedModel, checkpoint_kind, checkpoint_template, load_base, load_model, weights_dtype
from .messages import ROLES, check_messages
from .replies import TemplateChatSession, chat_reply, fit_messages, stream_chat_reply
from .templates import (JINJA_TEMPLATES, TEMPLATES, ChatTemplate, add_chat_tokens, encode_text, get_template,
                        parse_tool_call, render_chat, template_from_meta, tool_call_text, tools_template,
                        tools_text)
from .hermes import CHATML_TOOLS, ParsedCall, arguments_as_objects, parse_hermes_calls
from .jinja import JinjaChatTemplate
from .hf_templates import chat_template_jinja, read_chat_template
from .tools import ToolSet
from .calculator import TOOLS, CalculatorError, Tool, calculate, evaluate, get_tools
from .tool_loop import ToolCallRecord, ToolChatSession, ToolTurn, check_tool_template, run_tool_turn, run_tool_turns

__all__ = [
    "CHAT_TEMPLATE_KEY", "FORMATS", "Conversations", "as_conversations", "check_representable", "load_conversations",
    "LoadedModel", "load_model", "load_base", "weights_dtype", "checkpoint_kind", "checkpoint_template", "ROLES", "check_messages", "TemplateChatSession", "chat_reply",
    "fit_messages",
    "stream_chat_reply", "TEMPLATES", "ChatTemplate", "add_chat_tokens", "encode_text", "get_template",
    "render_chat", "template_from_meta", "tool_call_text", "tools_text", "tools_template", "parse_tool_call",
    "ToolSet", "message_text",
    "TOOLS", "CalculatorError", "Tool", "calculate", "evaluate", "get_tools", "ToolCallRecord", "ToolChatSession", "ToolTurn",
    "run_tool_turn", "run_tool_turns",
    "JinjaChatTemplate", "chat_template_jinja", "read_chat_template", "JINJA_TEMPLATES",
    "CHATML_TOOLS", "ParsedCall", "arguments_as_objects", "parse_hermes_calls", "check_tool_template",
]
