"""Chat templates across the Hugging Face boundary: the Jinja text of any template for the exporters
(:func:`chat_template_jinja` -- decoderlab's own templates written as Jinja that ``transformers``, vLLM and
llama.cpp render to the tokens decoderlab's renderer makes) and the template of a Hugging Face directory read
back (:func:`read_chat_template`: ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``,
with its named special tokens; decoderlab's own exported text comes back as the built-in template it was)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .jinja import SPECIAL_TOKEN_NAMES, JinjaChatTemplate
from .templates import TEMPLATES, ChatTemplate

#: the files ``transformers`` keeps a chat template in (its CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _lit(text: str) -> str:
    """A Jinja string literal of ``text``."""
    return json.dumps(text)


def _tag(statement: str, depth: int = 0) -> str:
    """One line of a template: a statement, trimming the whitespace on both sides (so the layout writes
    nothing)."""
    return "    " * depth + f"{{%- {statement} -%}}"


def _out(expression: str, depth: int = 0) -> str:
    """One line of a template: an expression's value, trimming the whitespace on both sides."""
    return "    " * depth + f"{{{{- {expression} -}}}}"


def _plus(text: str) -> str:
    return f" + {_lit(text)}" if text else ""


def _tools_lines(t: ChatTemplate, sep: str) -> list[str]:
    """The tools offered, as ``tools_text`` writes them: a JSON list of each function's name, description and
    parameters (those given), after ``<|tool|>`` and before ``<|end|>``."""
    lines = [_out(f"{_lit(t.tool + sep)} + '['", 2), _tag("for tool in tools", 2),
             _tag("set f = tool['function'] if tool['function'] is mapping else tool", 3),
             _tag("set ns = namespace(first=true)", 3), _out("('' if loop.first else ', ') + '{'", 3)]
    for key in ("name", "description", "parameters"):
        lines += [_tag(f"if {_lit(key)} in f", 3),
                  _out(f"('' if ns.first else ', ') + {_lit(json.dumps(key) + ': ')} + f[{_lit(key)}]|tojson", 4),
                  _tag("set ns.first = false", 4), _tag("endif", 3)]
    return lines + [_out("'}'", 3), _tag("endfor", 2), _out(f"']' + {_lit(sep + t.end + sep)}", 2)]


def _calls_lines(t: ChatTemplate, sep: str) -> list[str]:
    """An assistant message's tool calls, as ``tool_call_text`` writes them: ``<|tool_call|> NAME {ARGUMENTS}``
    (arguments given as an object written as JSON; as text, kept -- empty text is ``{}``)."""
    return [_tag("for call in message['tool_calls'] or []", 1),
            _tag("set fn = call['function'] if call['function'] is mapping else call", 2),
            _out(f"{_lit(t.tool_call + sep)} + fn['name'] + ' '", 2),
            _tag("if fn['arguments'] is string", 2), _out("fn['arguments'] if fn['arguments']|trim else '{}'", 3),
            _tag("else", 2), _out("fn['arguments']|tojson", 3), _tag("endif", 2),
            *([_out(_lit(sep), 2)] if sep else []), _tag("endfor", 1)]


def builtin_jinja(template: ChatTemplate, separator: str = "") -> str:
    """The Jinja text of a built-in (field-defined) template: rendered by ``transformers``, its text encodes to
    the ids :meth:`ChatTemplate.render` makes (each special token between texts; ``separator`` between the
    pieces -- a space for a word vocabulary, whose text is split on whitespace). Roles, tools or tool calls the
    template cannot write raise, naming them, as ``render`` refuses them."""
    t, sep = template, separator
    roles = {"system": t.system, "user": t.user, "assistant": t.assistant, **({"tool": t.tool} if t.has_tools else {})}
    name = _lit(f"the {t.name!r} chat template")
    lines = [f"{{#- decoderlab's {t.name!r} chat template -#}}", _tag("for message in messages")]
    if t.has_tools:
        lines += [_tag("if tools and loop.index0 == (1 if messages[0]['role'] == 'system' else 0)", 1),
                  *_tools_lines(t, sep), _tag("endif", 1)]
    else:
        lines += [_tag("if tools or message['tool_calls']", 1),
                  _out(f"raise_exception({name} + ' cannot render tools or tool calls (the \"tools\" template can)')",
                       2), _tag("endif", 1)]
    for k, (role, token) in enumerate(roles.items()):
        lines += [_tag(f"{'if' if k == 0 else 'elif'} message['role'] == {_lit(role)}", 1)]
        lines += [_out(_lit(token + sep), 2)] if token else []
    lines += [_tag("else", 1), _out(f"raise_exception({name} + ' has no role ' + message['role'] + ' (it has "
                                    f"{', '.join(roles)})')", 2), _tag("endif", 1),
              _out(f"(message['content'] or ''){_plus(sep)}", 1), *(_calls_lines(t, sep) if t.has_tools else []),
              _tag(f"if message['role'] in {json.dumps([r for r in roles if r != 'user' or t.end_after_user])}", 1),
              _out(_lit(t.end + sep), 2), _tag("endif", 1), _tag("endfor"),
              _tag("if add_generation_prompt"), _out(_lit(t.assistant + sep), 1), _tag("endif")]
    return "\n".join(lines)


def chat_template_jinja(template: ChatTemplate | JinjaChatTemplate, tokenizer=None) -> str:
    """The Jinja text of any chat template, for an exported model's ``tokenizer_config.json``
    (``chat_template``) or GGUF file (``tokenizer.chat_template``): a Jinja template's own text; a built-in
    one's written as Jinja (:func:`builtin_jinja`; pieces separated by the ``tokenizer``'s ``separator``, a
    space for a word vocabulary). A model fine-tuned with the template then chats in ``transformers``, vLLM and
    llama.cpp in the layout it learned."""
    if isinstance(template, JinjaChatTemplate):
        return template.source
    if not isinstance(template, ChatTemplate):
        raise TypeError(f"chat_template_jinja needs a ChatTemplate or a JinjaChatTemplate, got "
                        f"{type(template).__name__}")
    return builtin_jinja(template, getattr(tokenizer, "separator", "") or "")


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an AddedToken's ``{"content"}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _sources(directory: Path, config: dict) -> dict[str, str]:
    """The directory's templates by name, as ``transformers`` reads them: ``chat_template.jinja`` (and
    ``additional_chat_templates/*.jinja``) over ``tokenizer_config.json``'s ``chat_template`` (a text, or a list
    of ``{"name", "template"}``)."""
    sources: dict[str, str] = {}
    given = config.get("chat_template")
    if isinstance(given, str):
        sources["default"] = given
    elif isinstance(given, list):
        try:
            sources.update({t["name"]: t["template"] for t in given})
        except (TypeError, KeyError):
            raise ValueError(f"{directory / TOKENIZER_CONFIG_FILE}: chat_template must be a text or a list of "
                             f"{{\"name\", \"template\"}}") from None
    elif given is not None:
        raise ValueError(f"{directory / TOKENIZER_CONFIG_FILE}: chat_template must be a text or a list of "
                         f"{{\"name\", \"template\"}}, got {type(given).__name__}")
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        sources = {"default": (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")}
        extra = directory / CHAT_TEMPLATE_DIR
        if extra.is_dir():
            sources.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))})
    return sources


def read_chat_template(directory: str | os.PathLike) -> ChatTemplate | JinjaChatTemplate | None:
    """The chat template of a Hugging Face model directory, None when it has none: a
    :class:`JinjaChatTemplate` named ``jinja:<directory's name>`` with the named special tokens of
    ``tokenizer_config.json`` (or ``special_tokens_map.json``) -- or, when the text is one decoderlab wrote for
    a built-in template (:func:`chat_template_jinja`), that built-in template, tool calls included.

    Raises:
        ValueError: a file that is not valid JSON, a malformed ``chat_template``, a template that is not valid
            Jinja (each naming the file), several templates without a ``default``.
    """
    directory = Path(directory)
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    sources = _sources(directory, config)
    if not sources:
        return None
    for builtin in TEMPLATES.values():
        if list(sources) == ["default"] and sources["default"] in (builtin_jinja(builtin), builtin_jinja(builtin, " ")):
            return builtin
    extra = directory / "special_tokens_map.json"
    names = {**(_read_json(extra) if extra.is_file() else {}), **config}
    tokens = {k: _token_text(names[k]) for k in SPECIAL_TOKEN_NAMES if _token_text(names.get(k)) is not None}
    name = f"jinja:{directory.resolve().name}"
    try:
        return JinjaChatTemplate(sources, name=name, tokens=tokens)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
