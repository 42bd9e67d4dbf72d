"""The glass box's commands on a GGUF file of blocks: they read float weights, so a file that decoding keeps in its
blocks (``--dtype auto``) is dequantized for them -- `heads --composition` on a Q8_0 file refused its block layers
as "not an nn.Linear (LoRA adapters?)" once blocks became the default."""

from __future__ import annotations

import pytest

from decoderlab import cli
from decoderlab.glassbox.cache import plain_linear
from decoderlab.gguf import load_gguf


@pytest.mark.parametrize("command", [["heads", "--composition"], ["lens"]])
def test_commands_that_read_weights_take_a_block_file(tiny_gguf, capsys, command):
    path, _ = tiny_gguf("llama", "Q8_0")
    assert cli.main([*command, "--checkpoint", str(path), "hello world, hello world"]) == 0, capsys.readouterr().err
    assert "error" not in capsys.readouterr().err


def test_a_block_layer_is_named_with_what_to_load_instead(tiny_gguf):
    path, _ = tiny_gguf("llama", "Q8_0")
    model, _, _ = load_gguf(path)
    layer = model.blocks[0].attention.proj
    with pytest.raises(ValueError, match=r"blocks\.0\.attention\.proj holds q8_0 blocks .* dtype='float32'"):
        plain_linear(layer, "blocks.0.attention.proj")
    float_model, _, _ = load_gguf(path, dtype="float32")
    assert plain_linear(float_model.blocks[0].attention.proj, "p") is float_model.blocks[0].attention.proj
