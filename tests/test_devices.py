"""``resolve_device``: the names ``--device`` takes, and one line naming what this machine has for a device it
lacks -- on this CPU machine, and with torch's CUDA answers replaced to stand for a one-GPU machine."""

import os
import re

import pytest
import torch

from decoderlab.devices import machine_devices, resolve_device


def test_the_cpu_and_auto_on_a_machine_without_a_gpu():
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
        assert machine_devices() == ["cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_on_a_machine_without_one_names_what_it_has():
    for name in ("cuda", "cuda:0", "cuda:7"):
        with pytest.raises(ValueError, match=rf"^device {name}: no CUDA GPU here .*; this machine has: cpu"):
            resolve_device(name)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has Apple MPS")
def test_mps_off_a_mac_names_what_this_machine_has():
    with pytest.raises(ValueError, match=r"^device mps: Apple MPS is on Apple silicon Macs only .*; this machine "
                                         r"has: cpu"):
        resolve_device("mps")


def test_an_unknown_device_lists_the_names_allowed():
    for name in ("tpu", "cuda:x", "gpu", "cpu:1", ""):
        with pytest.raises(ValueError, match=rf"^device {name}: not a device decoderlab knows; allowed: auto, cpu, "
                                             r"cuda, cuda:N, mps \(this machine has: cpu"):
            resolve_device(name)


def test_a_gpu_number_past_the_last_on_a_one_gpu_machine(monkeypatch):
    """torch's CUDA answers stand for a machine with one GPU (nothing is put on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert machine_devices() == ["cpu", "cuda:0"]
    assert resolve_device("auto") == resolve_device("cuda") == resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"^device cuda:7: there is no CUDA GPU 7, only 1 \(cuda:0\); this machine "
                                         r"has: cpu, cuda:0$"):
        resolve_device("cuda:7")


def test_cpu_features_are_the_flags_of_proc_cpuinfo_that_decide_the_dtypes():
    from pathlib import Path

    from decoderlab.devices import CPU_FEATURES, cpu_features, cpu_summary

    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo here")
    flags = set(next(line for line in info.read_text().splitlines() if line.startswith("flags")).split(":")[1].split())
    have = cpu_features()
    assert have == [f for f in CPU_FEATURES if f in flags]
    summary = cpu_summary()
    assert f"{os.cpu_count()} CPUs: " in summary and " ".join(have) in summary and "torch kernels " in summary
    lacks = [f for f in CPU_FEATURES if f not in flags]
    assert (f"(no {', '.join(lacks)})" in summary) == bool(lacks)


def test_machine_line_names_the_cpu_torch_threads_and_load():
    """The header of every benchmark table: the CPU (cpu_summary), torch's version, the threads and the load."""
    from decoderlab.devices import cpu_summary, machine_line

    line = machine_line(3)
    assert line.startswith(f"machine: {cpu_summary()}; torch {torch.__version__}, 3 intra-op thread(s); ")
    assert re.search(r"load (average \d+\.\d \d+\.\d \d+\.\d|unknown)$", line)
