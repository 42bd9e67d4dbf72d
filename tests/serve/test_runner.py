"""``serve`` through the real command: ``decoderlab serve --checkpoint DIR`` in a subprocess, a decoderlab
checkpoint or a Hugging Face GPT-2 directory; bad command lines are one error line."""

from __future__ import annotations

import re
import socket
import threading

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import decoderlab as dl  # noqa: E402

from support.caches import own_cache  # noqa: E402

from .helpers import ref_text, client, cli_server  # noqa: E402


def test_cli_serve_runs_a_checkpoint(mt, tmp_path):
    model, tok = mt
    dl.save_checkpoint(tmp_path / "ck", model, tok)
    with cli_server(tmp_path / "ck", "--api-key", "k", "--eager") as url:
        r = client(url, "k").completions.create(model="ck", prompt="ab", max_tokens=4, temperature=0)
        assert r.choices[0].text == ref_text(mt, tok.encode("ab"), 4, 0, None)


def test_cli_serve_runs_a_hugging_face_gpt2_directory(tmp_path):
    """A Hugging Face GPT-2 directory (config.json + weights + vocab.json/merges.txt) is a checkpoint for
    serve too; /v1/completions equals generate on the same directory."""
    transformers = pytest.importorskip("transformers")
    from decoderlab.chat import load_model

    bpe = dl.BPETokenizer.train("To be, or not to be, that is the question.\n" * 8, 280)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=bpe.vocab_size, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=None,
        eos_token_id=None))
    hf.save_pretrained(tmp_path / "gpt2-tiny")
    bpe.hf_tokenizer.model.save(str(tmp_path / "gpt2-tiny"))  # vocab.json, merges.txt
    model, tok, _, _ = load_model(tmp_path / "gpt2-tiny")
    with cli_server(tmp_path / "gpt2-tiny", "--eager") as url:
        c = client(url)
        assert c.models.list().data[0].id == "gpt2-tiny"
        for temperature, seed in ((0, None), (1.0, 3)):
            r = c.completions.create(model="gpt2-tiny", prompt="To be", max_tokens=6, temperature=temperature,
                                     seed=seed)
            assert r.choices[0].text == ref_text((model, tok), tok.encode("To be"), 6, temperature, seed)


def test_cli_serve_runs_a_gguf_file_with_its_chat_template(tmp_path):
    """A GGUF file (llama.cpp's) is a checkpoint for serve too: its name is the model id, /v1/chat/completions
    renders its tokenizer.chat_template, and the reply equals the library's chat_reply on the same file."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    from decoderlab.chat import chat_reply, load_model

    bpe = byte_level_bpe(300)
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", hf_model("qwen2", bpe.get_vocab_size()), bpe)
    model, tok, template, _ = load_model(path)
    messages = [{"role": "user", "content": "Hi there"}]
    want = chat_reply(model, messages, tok, template, temperature=0, max_new_tokens=5)
    with cli_server(path, "--eager") as url:
        c = client(url)
        assert c.models.list().data[0].id == "tiny.gguf"
        r = c.chat.completions.create(model="tiny.gguf", messages=messages, max_tokens=5, temperature=0)
        assert r.choices[0].message.content == want


@pytest.mark.parametrize("args,needle", [(["--checkpoint", "/no/such/dir"], "/no/such/dir"),
                                         (["--checkpoint", ".", "--port", "70000"], "--port"),
                                         (["--checkpoint", ".", "--max-tokens", "0"], "--max-tokens"),
                                         (["--checkpoint", ".", "--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
                                         (["--checkpoint", ".", "--prefill-chunk", "-3"], "got -3"),
                                         (["--checkpoint", ".", "--threads", "0"], "--threads must be >= 1"),
                                         (["--checkpoint", ".", "--dtype", "q2_k"], "unknown --dtype 'q2_k'; allowed: "
                                                                                    "auto, float32, bfloat16")])
def test_cli_serve_bad_input_is_one_error_line(args, needle, capsys):
    from decoderlab.cli import main as cli_main

    try:
        status = cli_main(["serve", *args])
    except SystemExit as e:  # refused by the parser: before anything loads
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("decoderlab: error:") and needle in err[0]


@pytest.mark.slow
def test_cli_serve_q8_0_compiled_gives_the_eager_texts(mt, tmp_path):
    """`serve --dtype q8_0 --compile` decodes through the compiled step (the default from a million parameters;
    this tiny model needs --compile) -- Inductor compiles the one-row step before serving and one graph for every
    batch of two or more rows at the first such request, said on standard error -- and answers four requests
    sent together -- batched steps, each block read once for all rows -- with the texts of the library on the
    q8_0 model (which the eager server gives: this tiny model's default). The server keeps the kernels `make
    install` built (its own cache root would build them again: 20-25 s)."""
    from concurrent.futures import ThreadPoolExecutor

    model, tok = mt
    dl.save_checkpoint(tmp_path / "ck", model, tok)
    asks = [("ab", 0, None), ("ba", 0, None), ("abc", 1.0, 3), ("c", 1.0, 4)]
    with cli_server(tmp_path / "ck", "--dtype", "q8_0", "--compile", env={"DECODERLAB_CACHE": str(own_cache(tmp_path))}) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1200)
        with ThreadPoolExecutor(len(asks)) as pool:
            done = [pool.submit(lambda a=a: c.completions.create(model="ck", prompt=a[0], max_tokens=12,
                                                                 temperature=a[1], seed=a[2]).choices[0].text)
                    for a in asks]
            texts = [d.result() for d in done]
    q8, _ = dl.load_checkpoint(tmp_path / "ck", dtype="q8_0")
    assert texts == [ref_text((q8, tok), tok.encode(p), 12, t, s) for p, t, s in asks]


def test_serve_on_a_busy_port_or_a_bogus_host_is_one_error_line(mt, tmp_path, capsys):
    """Checked before the checkpoint is loaded, in decoderlab's words naming what was given."""
    from decoderlab.cli import main as cli_main
    from decoderlab.serve import serve

    model, tok = mt
    dl.save_checkpoint(tmp_path / "ck", model, tok)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*another --port"):
            serve(tmp_path / "ck", port=port)
        assert cli_main(["serve", "--checkpoint", str(tmp_path / "ck"), "--port", str(port)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("decoderlab: error:") and str(port) in err[0], err
    with pytest.raises(ValueError, match="bogus.invalid"):
        serve(tmp_path / "ck", host="bogus.invalid")
    assert cli_main(["serve", "--checkpoint", str(tmp_path / "ck"), "--host", "bogus.invalid"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("decoderlab: error:") and "--host 'bogus.invalid'" in err[0], err


def test_serve_threads_below_one_is_refused_before_the_port_is_bound(mt, tmp_path):
    from decoderlab.serve import serve

    model, tok = mt
    dl.save_checkpoint(tmp_path / "ck", model, tok)
    with pytest.raises(ValueError, match="threads must be a positive integer, got 0"):
        serve(tmp_path / "ck", port=1, threads=0)  # (port 1 would be refused: the threads are checked first)


class SlowScheduler:
    """A stand-in for the scheduler in a warm-up: its one request ends when ``release`` is set (a warm-up as
    slow as the test wants, without timing anything)."""

    def __init__(self):
        self.release = threading.Event()

    def submit(self, request):
        def finish():
            assert self.release.wait(SAFETY)
            request.on_event(("done", 0, "length"))

        threading.Thread(target=finish, daemon=True).start()


SAFETY = 60  # seconds a test waits for a line it expects (a net, not a measurement)


def _released_after(n: int, scheduler: SlowScheduler, lines: list):
    """A ``say`` that keeps each line and lets the warm-up end once ``n`` lines are said."""
    def say(line):
        lines.append(line)
        if len(lines) >= n:
            scheduler.release.set()
    return say


def test_a_slow_warm_up_says_its_progress_with_the_time_left_of_the_measured_one(monkeypatch):
    from decoderlab import waiting
    from decoderlab.serve.runner import warm_up

    monkeypatch.setattr(waiting, "EVERY", 0.001)
    lines, sch = [], SlowScheduler()
    seconds = warm_up(sch, say=_released_after(2, sch, lines), expected=3600)
    assert len(lines) >= 2 and all(re.fullmatch(r"warming up: \d+ s so far, ~\d+ s left", x) for x in lines), lines
    assert seconds >= 0
    lines, sch = [], SlowScheduler()
    warm_up(sch, say=_released_after(1, sch, lines))  # nothing measured: the time so far only
    assert re.fullmatch(r"warming up: \d+ s so far", lines[0]), lines


def test_the_warm_up_promises_no_time_but_the_one_measured_here(mt, monkeypatch, tmp_path, capsys):
    """It said "up to a minute on a CPU" (SmolLM2's took 265 s): now its first line names the time the last
    warm-up of this model's shape took on this machine, or says there is none yet; its time when done is
    recorded for the next one."""
    from decoderlab import waiting
    from decoderlab.serve.runner import warm_up_said
    from decoderlab.waiting import MeasuredWaits

    monkeypatch.setattr(waiting, "EVERY", 0.001)
    model, _ = mt
    waits = MeasuredWaits(tmp_path / "waits.json")
    sch = SlowScheduler()
    sch.release.set()
    warm_up_said(sch, model, waits)
    first, *_, done = capsys.readouterr().err.splitlines()
    assert first.startswith("decoderlab: warming up the compiled decode step before serving") and "minute" not in first
    assert first.endswith("(nothing measured yet to estimate its time from: it is said when done) ...")
    assert re.fullmatch(r"decoderlab: warmed up in \d+ s \(a batch of several rows compiles at its first request\)",
                        done)
    (kept,) = waits.records()
    waits.record(kept["kind"], kept["key"], kept["size"], 131.0)  # as if the last warm-up had taken 131 s
    lines, sch = [], SlowScheduler()
    monkeypatch.setattr("decoderlab.serve.runner.say", _released_after(3, sch, lines))
    warm_up_said(sch, model, waits)
    assert lines[0].endswith("(~131 s: the last one of this shape took 131 s here) ...")
    assert re.fullmatch(r"warming up: \d+ s so far, ~1[23]\d s left", lines[1]), lines


def test_the_socket_listens_before_the_address_is_said():
    """A client that connects once `serving ... on http://...` is said waits in the kernel's queue for uvicorn,
    never "Connection refused" (the socket was bound only, and uvicorn made it listen later)."""
    from decoderlab.serve.runner import listen

    sock = listen("127.0.0.1", 0)
    try:
        socket.create_connection(sock.getsockname(), timeout=10).close()
    finally:
        sock.close()
