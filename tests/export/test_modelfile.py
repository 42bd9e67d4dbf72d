"""The ollama Modelfile beside an exported GGUF file: FROM the file beside it; a built-in template as ollama's Go
TEMPLATE (opener, content, end per message, then the assistant's opener) with its stop tokens; a Jinja template
left to ollama (it reads tokenizer.chat_template from the file) with the end of turn as the stop."""

from __future__ import annotations

from pathlib import Path

from decoderlab.chat import TEMPLATES, JinjaChatTemplate
from decoderlab.export.modelfile import modelfile_path, modelfile_text
from decoderlab.tokenizers import BPETokenizer


def test_a_builtin_template_is_written_as_a_go_template():
    text = modelfile_text(Path("runs/m.gguf"), TEMPLATES["decoderlab"], None, None)
    assert text == """# ollama create NAME -f m.Modelfile
FROM ./m.gguf
TEMPLATE \"\"\"{{- range .Messages }}
{{- if eq .Role "system" }}<|system|>{{ .Content }}<|end|>
{{- else if eq .Role "user" }}<|user|>{{ .Content }}<|end|>
{{- else if eq .Role "assistant" }}<|assistant|>{{ .Content }}<|end|>
{{- end }}
{{- end }}<|assistant|>\"\"\"
PARAMETER stop "<|end|>"
PARAMETER stop "<|user|>"
PARAMETER stop "<|system|>"
"""


def test_a_jinja_template_is_left_to_ollama_with_its_end_of_turn_as_stop():
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = BPETokenizer(hf)
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    text = modelfile_text(Path("m.gguf"), JinjaChatTemplate(chatml), tok, chatml)
    assert "TEMPLATE" not in text and 'PARAMETER stop "<|im_end|>"' in text and "tokenizer.chat_template" in text
    assert modelfile_text(Path("m.gguf"), None, tok, None) == ('# ollama create NAME -f m.Modelfile\nFROM ./m.gguf\n'
                                                               'TEMPLATE "{{ .Prompt }}"\n')
    assert modelfile_path(Path("a/b.gguf")) == Path("a/b.Modelfile")
    assert modelfile_path(Path("c")) == Path("c.Modelfile")
