"""An ollama ``Modelfile`` beside an exported GGUF file, so that ``ollama create NAME -f model.Modelfile`` makes a
model that chats in its own format.

``FROM`` names the GGUF file (relative: the two travel together). A built-in decoderlab template (``decoderlab``,
``tools``, ``lesson``) is written as ollama's Go ``TEMPLATE`` -- each message as the template's opener, its
content and the end token, then the assistant's opener -- since ollama knows nothing of them; a Jinja template
(a Hugging Face or GGUF model's own) is left to ollama, which reads ``tokenizer.chat_template`` from the file
and recognises the common ones (ChatML, Llama 3, ...). ``PARAMETER stop`` lists the end-of-turn token and the
turn openers, where generation must stop. A model without a template (a completion model) gets the prompt as it
is (``TEMPLATE "{{ .Prompt }}"``) and its end of text as the stop.

Source: ollama's Modelfile reference (docs/modelfile.md: FROM, TEMPLATE with ``.Messages`` / ``.Role`` /
``.Content``, PARAMETER stop).
"""

from __future__ import annotations

from pathlib import Path


def modelfile_path(gguf_path: Path) -> Path:
    """``model.gguf`` -> ``model.Modelfile`` in the same directory."""
    return gguf_path.with_name(gguf_path.stem + ".Modelfile") if gguf_path.suffix.lower() == ".gguf" \
        else gguf_path.with_name(gguf_path.name + ".Modelfile")


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def go_template(template) -> str:
    """A built-in ``ChatTemplate`` as ollama's Go template: ``[opener] content [end]`` per message (a user turn
    without ``end`` when the template leaves it open), then the assistant's opener."""
    def turn(opener, end):
        return f"{opener or ''}{{{{ .Content }}}}{end or ''}"

    user_end = template.end if template.end_after_user else None
    lines = ["{{- range .Messages }}"]
    if template.system:
        lines.append(f'{{{{- if eq .Role "system" }}}}{turn(template.system, template.end)}')
        lines.append(f'{{{{- else if eq .Role "user" }}}}{turn(template.user, user_end)}')
    else:
        lines.append(f'{{{{- if eq .Role "user" }}}}{turn(template.user, user_end)}')
    lines.append(f'{{{{- else if eq .Role "assistant" }}}}{turn(template.assistant, template.end)}')
    lines += ["{{- end }}", "{{- end }}" + template.assistant]
    return "\n".join(lines)


def modelfile_text(gguf_path: Path, template, tokenizer, chat_template: str | None) -> str:
    """The Modelfile of ``gguf_path`` with ``template`` (a built-in ``ChatTemplate``, a ``JinjaChatTemplate`` or
    None) and ``tokenizer`` (for the end-of-turn token's text)."""
    from ..chat import ChatTemplate

    lines = ["# ollama create NAME -f " + modelfile_path(gguf_path).name, f"FROM ./{gguf_path.name}"]
    if template is None:  # a completion model: the prompt as it is, up to its end of text
        eos = getattr(tokenizer, "eos_id", None)
        lines.append('TEMPLATE "{{ .Prompt }}"')
        if eos is not None:
            lines.append(f"PARAMETER stop {_quoted(tokenizer.id_to_token[eos])}")
        return "\n".join(lines) + "\n"
    if isinstance(template, ChatTemplate):
        lines.append(f'TEMPLATE """{go_template(template)}"""')
        stops = [template.end, *(t for t in (template.user, template.system) if t and t != template.end)]
    else:
        lines.insert(1, "# the chat template is the GGUF file's tokenizer.chat_template (Jinja), which ollama reads")
        stops = [template.end_of_turn(tokenizer)]
    lines += [f"PARAMETER stop {_quoted(s)}" for s in dict.fromkeys(stops)]
    return "\n".join(lines) + "\n"
