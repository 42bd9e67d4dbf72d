"""The ids a Hugging Face model's generation stops at (decoderlab.hf.generation_config): ``eos_token_id`` -- one
id or a list -- of generation_config.json, or of config.json when there is no generation_config.json, as
transformers' ``generate`` reads it. A tiny random Llama whose greedy continuation reaches the second id of such
a list stops there in transformers, in ``decoderlab.load(dir)`` + ``generate`` and on the command line (token
for token); a list that names ids outside the vocabulary is one ``decoderlab: error:`` line; the list is kept
through a decoderlab checkpoint and written back by an export.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import decoderlab as dl  # noqa: E402
from decoderlab.cli import main as cli_main  # noqa: E402
from decoderlab.generation.stops import text_decoder  # noqa: E402
from decoderlab.tokenizers import Tokenizer  # noqa: E402

from .families import greedy_tokens, hf_directory  # noqa: E402

TEXT = "To be, or not to be"
N = 20


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(directory, its prompt ids, transformers' greedy continuation without a stop, the tokenizer's eos id,
    the id the list adds: an ordinary token the continuation first reaches at its 5th step, before any eos)."""
    path = tmp_path_factory.mktemp("llama")
    hf, auto = hf_directory(path, "llama", spare_rows=0)  # (no [PAD{id}] rows: control tokens, which end a text)
    ids = auto(TEXT)["input_ids"]
    free = greedy_tokens(hf, ids, N)
    stop = free[4]
    assert stop not in free[:4] and stop not in auto.all_special_ids and auto.eos_token_id not in free[:5]
    assert not set(free) & (set(auto.all_special_ids) - {auto.eos_token_id})  # <s>, <unk>: ends of ours alone
    return path, ids, free, auto.eos_token_id, stop


def write_json(path, name, **fields):
    data = json.loads((path / name).read_text()) if (path / name).is_file() else {}
    (path / name).write_text(json.dumps({**data, **fields}))


def transformers_generate(path, ids) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def cli_text(path, capsys) -> str:
    capsys.readouterr()
    assert cli_main(["generate", "--checkpoint", str(path), "--max-new-tokens", str(N), "--temperature", "0",
                     "--eager", TEXT]) == 0
    return capsys.readouterr().out


def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_generation_stops_at_every_eos_token_id_of_the_list(tmp_path, capsys, llama, where):
    path, ids, free, eos, stop = llama
    path = copy_dir(path, tmp_path / "model")
    if where == "config.json":  # no generation_config.json: transformers reads config.json's
        (path / "generation_config.json").unlink()
    write_json(path, where, eos_token_id=[eos, stop])
    want = transformers_generate(path, ids)
    assert want == free[:5] and want[-1] == stop  # transformers stops at the list's second id, and writes it
    m = dl.load(path)
    assert dl.generate(m.model, ids, N, temperature=0, tokenizer=m.tokenizer) == want[:-1]  # ours, before it
    assert m.generate(TEXT, max_new_tokens=N, temperature=0) == text_decoder(m.tokenizer)(want[:-1])
    assert cli_text(path, capsys).rstrip("\n") == text_decoder(m.tokenizer)(want[:-1])
    assert dl.generate(m.model, ids, N, temperature=0, tokenizer=m.tokenizer, stop_at_eos=False) == free


def test_generation_config_json_wins_over_config_json(tmp_path, capsys, llama):
    """With a generation_config.json, transformers reads config.json's eos_token_id not at all: a list there
    ends nothing, here as there."""
    path, ids, free, eos, stop = llama
    path = copy_dir(path, tmp_path / "model")
    write_json(path, "config.json", eos_token_id=[eos, stop])
    write_json(path, "generation_config.json", eos_token_id=eos)
    want = transformers_generate(path, ids)
    assert want == free[:want.index(eos) + 1] if eos in free else want == free
    m = dl.load(path)
    assert dl.generate(m.model, ids, N, temperature=0, tokenizer=m.tokenizer) == [t for t in want if t != eos]
    assert stop not in m.tokenizer.end_of_text_ids


def test_the_list_is_kept_by_a_checkpoint_and_written_back_by_an_export(tmp_path, llama):
    path, ids, free, eos, stop = llama
    path = copy_dir(path, tmp_path / "model")
    write_json(path, "generation_config.json", eos_token_id=[stop, eos])
    m = dl.load(path)
    assert m.tokenizer.eos_ids == (stop, eos) and set(m.tokenizer.end_of_text_ids) >= {stop, eos}
    saved = Tokenizer.load(m.tokenizer.save(tmp_path / "tokenizer.json"))
    assert saved.eos_ids == (stop, eos) and saved.end_of_text_ids == m.tokenizer.end_of_text_ids
    with_turns = m.tokenizer.add_special_tokens(["<|im_start|>"])  # a chat template's tokens keep the list
    assert with_turns.eos_ids == (stop, eos)
    m.to_hf(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [eos, stop]
    assert transformers_generate(tmp_path / "out", ids) == free[:5]


@pytest.mark.parametrize("value,words", [
    ([2, 10**6], "eos_token_id [2, 1000000] names id 1000000; allowed: token ids 0 .. "),
    ("</s>", "eos_token_id '</s>' names id '</s>'; allowed: token ids 0 .. "),
    ([True], "eos_token_id [True] names id True; allowed: token ids 0 .. "),
])
def test_an_eos_token_id_outside_the_vocabulary_is_one_error_line(tmp_path, capsys, llama, value, words):
    path, *_ = llama
    path = copy_dir(path, tmp_path / "model")
    write_json(path, "generation_config.json", eos_token_id=value)
    capsys.readouterr()
    assert cli_main(["generate", "--checkpoint", str(path), "--max-new-tokens", "2", TEXT]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("decoderlab: error: ")
    assert f"{path / 'generation_config.json'}: {words}" in captured.err, captured.err
