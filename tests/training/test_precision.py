"""``--precision auto``: the precision chosen for the machine (tested on faked device properties), printed
once, the float32 matmul precision on CUDA, and the refusals (16-mixed on the CPU; under --strategy fsdp)."""

import pytest
import torch

from decoderlab import cli
from decoderlab.config.names import PRECISIONS
from decoderlab.training import TrainConfig
from decoderlab.training import precision as P
from decoderlab.training.precision import Machine, choose_precision, detect_machine, resolve_precision

A100 = Machine("cuda", "NVIDIA A100-SXM4-80GB", bf16=True)
T4 = Machine("cuda", "Tesla T4", bf16=False)
CPU, MPS = Machine("cpu", "cpu"), Machine("mps", "Apple MPS")


@pytest.mark.parametrize("machine, strategy, expected", [
    (A100, "auto", "bf16-mixed"), (A100, "fsdp", "bf16-mixed"), (A100, "ddp", "bf16-mixed"),
    (T4, "auto", "16-mixed"), (T4, "ddp", "16-mixed"),
    (T4, "fsdp", "32"),  # FSDP2 takes no float16 autocast: float32 rather than a refusal of the default
    (CPU, "auto", "32"), (CPU, "fsdp", "32"), (MPS, "auto", "32"),
])
def test_auto_resolves_for_the_machine(machine, strategy, expected):
    precision, why = resolve_precision("auto", machine, strategy=strategy)
    assert precision == expected and why


@pytest.mark.parametrize("machine", [A100, T4, CPU, MPS])
@pytest.mark.parametrize("asked", ["32", "bf16-mixed"])
def test_an_explicit_precision_is_kept(machine, asked):
    assert resolve_precision(asked, machine) == (asked, "asked for")


def test_16_mixed_on_the_cpu_or_under_fsdp_is_refused_naming_the_alternatives():
    with pytest.raises(ValueError, match=r"--precision 16-mixed .* needs a GPU; on the CPU use --precision 32 "
                                         r"\(the default there, auto\) or bf16-mixed"):
        resolve_precision("16-mixed", CPU)
    with pytest.raises(ValueError, match=r"cannot run under --strategy fsdp .*use --precision bf16-mixed or 32, "
                                         r"or --strategy ddp"):
        resolve_precision("16-mixed", T4, strategy="fsdp")
    assert resolve_precision("16-mixed", T4) == ("16-mixed", "asked for")
    assert resolve_precision("16-mixed", MPS) == ("16-mixed", "asked for")
    with pytest.raises(ValueError, match="precision must be one of auto, 32, bf16-mixed, 16-mixed, got 'fp8'"):
        resolve_precision("fp8", A100)


def _fake_cuda(monkeypatch, name, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)


@pytest.mark.parametrize("name, capability, bf16", [
    ("Tesla T4", (7, 5), False), ("Tesla V100-SXM2-16GB", (7, 0), False), ("NVIDIA A100-SXM4-80GB", (8, 0), True),
    ("NVIDIA H100 80GB HBM3", (9, 0), True)])
def test_detect_machine_reads_the_cuda_device_properties(monkeypatch, name, capability, bf16):
    _fake_cuda(monkeypatch, name, capability)
    for accelerator in ("auto", "gpu", "cuda"):
        assert detect_machine(accelerator) == Machine("cuda", name, bf16)
    assert detect_machine("cpu") == CPU
    assert resolve_precision("auto", detect_machine())[0] == ("bf16-mixed" if bf16 else "16-mixed")


def test_detect_machine_prefers_cuda_then_mps_then_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert detect_machine("auto") == MPS
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert detect_machine("auto") == CPU


def test_each_choice_is_printed_once_and_cuda_gets_the_high_matmul_precision(monkeypatch, capsys):
    monkeypatch.setattr(P, "_announced", set())
    before = torch.get_float32_matmul_precision()
    try:
        assert choose_precision("auto", machine=A100) == "bf16-mixed"
        assert torch.get_float32_matmul_precision() == "high"
        first = capsys.readouterr().err.splitlines()
        assert first == ["decoderlab: precision bf16-mixed (auto: NVIDIA A100-SXM4-80GB computes in bfloat16)",
                         "decoderlab: float32 matrix products at precision 'high' (TF32 where the GPU has it)"]
        assert choose_precision("auto", machine=A100) == "bf16-mixed"
        assert capsys.readouterr().err == ""  # once per process
        assert choose_precision("auto", machine=T4) == "16-mixed"
        assert capsys.readouterr().err.splitlines()[0].startswith("decoderlab: precision 16-mixed (auto: Tesla T4")
    finally:
        torch.set_float32_matmul_precision(before)
    torch.set_float32_matmul_precision("highest")
    try:
        assert choose_precision("auto", machine=CPU) == "32"
        assert torch.get_float32_matmul_precision() == "highest"  # the CPU's is left alone
        assert capsys.readouterr().err == ""  # the CPU keeps float32 without a word
    finally:
        torch.set_float32_matmul_precision(before)


def test_auto_is_the_default_and_a_known_name():
    assert TrainConfig().precision == "auto" and PRECISIONS[0] == "auto"
    help_text = cli.build_parser(["train"])._subparsers._group_actions[0].choices["train"].format_help()
    assert "{" + ",".join(PRECISIONS) + "}" in " ".join(help_text.split())  # the flag offers the config's names


def test_cli_16_mixed_on_the_cpu_is_one_line_naming_the_alternatives(tmp_path, shared_dir, capsys, monkeypatch):
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:3000],
                      encoding="utf-8")
    assert cli.main(["train", "--precision", "16-mixed", "--data", str(corpus), "--out", str(tmp_path / "run"),
                     "--max-steps", "1", "--no-progress-bar"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["decoderlab: error: --precision 16-mixed (float16 autocast with a gradient scaler) "
                                "needs a GPU; on the CPU use --precision 32 (the default there, auto) or bf16-mixed"]
    assert not (tmp_path / "run").exists()
