"""decoderlab.kernels.huge_pages: the pages under a model's weights made huge -- in place where the kernel
collapses ranges (MADV_COLLAPSE, Linux 6.1+), else copied into one mapping advised MADV_HUGEPAGE: the same values
and outputs, tied weights still tied, each copied tensor its own storage (safetensors saves them), views left where
they are; and the one loader does it."""

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import decoderlab as dl
from decoderlab import kernels
from decoderlab.dtypes import to_inference_dtype
from decoderlab.kernels import pages

linux_only = pytest.mark.skipif(not pages.available(), reason="transparent huge pages are Linux's")


def _model(tie: bool = True, **shape) -> dl.DecoderOnlyTransformer:
    torch.manual_seed(0)
    shape = {"num_tokens": 64, "d_model": 64, "n_layer": 2, "n_head": 4, "max_len": 32, **shape}
    return dl.DecoderOnlyTransformer(dl.ModelConfig(tie_weights=tie, **shape)).eval()


def _smaps(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps fields of the mapping of this process that holds ``address``."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                fields[head.rstrip(":")] = line.split()[1:]
    if not fields:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def _vm_flags(address: int) -> list[str]:
    return _smaps(address)["VmFlags"]


def _huge_kb_over(t: torch.Tensor) -> int:
    """AnonHugePages of every mapping overlapping ``t``'s bytes, kB (a heap glibc grew in steps is several
    mappings; memory an earlier collapse left huge may be reused, so the tests read the state after, not a
    difference)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(v, 16) for v in head.split("-"))
                overlaps = a < hi and lo < b
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.fixture
def copying(monkeypatch):
    """The path of a kernel without MADV_COLLAPSE: the copy into an advised mapping."""
    monkeypatch.setattr(pages, "collapse_works", lambda: False)


@pytest.mark.skipif(not pages.collapse_works(), reason="this kernel has no MADV_COLLAPSE (Linux 6.1+)")
def test_the_pages_under_the_weights_become_huge_in_place():
    model = _model(num_tokens=40960, d_model=256)  # a 40 MiB embedding: at least 19 whole huge pages
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        before = model(ids)
    at = model.we.weight.data_ptr()
    assert kernels.huge_pages(model) >= 40 << 20
    assert model.we.weight.data_ptr() == at  # nothing moved
    assert _huge_kb_over(model.we.weight) >= 38 << 10
    with torch.no_grad():
        assert torch.equal(model(ids), before)


@pytest.mark.skipif(not pages.collapse_works(), reason="this kernel has no MADV_COLLAPSE (Linux 6.1+)")
def test_a_collapse_in_the_background_leaves_the_pages_huge_when_waited_for():
    weight = torch.randn(10 << 20)  # 40 MiB: at least 19 whole huge pages
    want = weight.clone()
    wait = pages.collapse_in_background([weight])
    wait()
    assert _huge_kb_over(weight) >= 38 << 10 and torch.equal(weight, want)


@linux_only
def test_the_weights_move_into_one_huge_page_mapping_with_the_same_outputs(copying):
    model = _model()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        before = model(ids)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    moved = kernels.huge_pages(model, min_bytes=0)
    assert moved >= sum(v.numel() * v.element_size() for v in params.values())
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, values[k]), k
    assert dict(model.named_parameters()) == params  # the same Parameter objects, requires_grad kept
    assert all(p.requires_grad for p in model.parameters())
    assert model.we.weight is model.fc_layer.weight  # still tied
    assert "hg" in _vm_flags(model.we.weight.data_ptr())
    assert "hg" not in _vm_flags(ids.data_ptr())  # (the test tells: an ordinary tensor's mapping has no advice)


@linux_only
def test_each_moved_tensor_owns_its_storage_and_safetensors_saves_them(tmp_path, copying):
    model = _model(tie=False)
    kernels.huge_pages(model, min_bytes=0)
    state = model.state_dict()
    for v in state.values():
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    back = load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in state.items())


@linux_only
def test_block_weights_move_and_multiply_as_before(copying):
    model = to_inference_dtype(_model(d_model=64), "q8_0")
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        before = model(ids)
        kernels.huge_pages(model, min_bytes=0)
        assert torch.equal(model(ids), before)
    packed = [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith("packed_")]
    assert packed and all("hg" in _vm_flags(b.data_ptr()) for b in packed)


@linux_only
def test_a_view_and_a_shared_storage_stay_where_they_are(copying):
    layer = torch.nn.Linear(16, 16)
    layer.register_buffer("half_view", layer.weight.detach()[:8])
    other = torch.nn.Module()
    other.a, other.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    both = torch.nn.ModuleDict({"layer": layer, "other": other})
    view_at = layer.half_view.data_ptr()
    kernels.huge_pages(both, min_bytes=0)
    assert layer.half_view.data_ptr() == view_at  # a view of another tensor's storage: not moved
    assert layer.weight.data_ptr() == view_at  # nor the storage it shares
    assert "hg" in _vm_flags(other.a.weight.data_ptr())


@pytest.mark.parametrize("collapse", [True, False])
def test_too_few_bytes_or_no_huge_pages_moves_nothing(monkeypatch, collapse):
    monkeypatch.setattr(pages, "collapse_works", lambda: collapse)
    model = _model(n_layer=1, d_model=32)  # 40 KB of weights: under one huge page, nothing to gain
    at = model.we.weight.data_ptr()
    assert kernels.huge_pages(model) == 0
    monkeypatch.setattr(pages, "available", lambda: False)
    assert kernels.huge_pages(model, min_bytes=0) == 0
    assert model.we.weight.data_ptr() == at


@linux_only
def test_the_one_loader_puts_a_models_weights_in_huge_pages(tmp_path, monkeypatch):
    from decoderlab.chat import load_model
    from decoderlab.checkpoint import save_checkpoint

    tok = dl.CharTokenizer.from_text("".join(chr(32 + i) for i in range(90)))
    model = _model(num_tokens=tok.vocab_size, d_model=256, n_layer=3)  # 2.5 MiB of weights: over one huge page
    path = save_checkpoint(tmp_path / "ckpt", model, tok, meta={"task": "lm"})
    calls = []
    real = pages.huge_pages
    monkeypatch.setattr("decoderlab.chat.loading.huge_pages", lambda m, *a: calls.append(m) or real(m, *a))
    loaded = load_model(path)
    assert calls == [loaded.model] and real(loaded.model) > 0  # (its pages huge: the call's own test above)
    assert torch.equal(loaded.model.we.weight, model.we.weight)


def test_a_kernel_with_huge_pages_switched_off_or_absent_gets_none(tmp_path, monkeypatch):
    """The platform check reads the kernel's switch: ``never`` in force, or no such file, is no huge pages."""
    setting = tmp_path / "enabled"
    monkeypatch.setattr(pages, "THP_SETTING", str(setting))
    cases = [("always madvise [never]\n", False), ("always [madvise] never\n", True), (None, False)]
    for text, want in cases:
        if text is None:
            setting.unlink()
        else:
            setting.write_text(text)
        pages.available.cache_clear()
        try:
            assert pages.available() is (want and sys.platform.startswith("linux")), text
        finally:
            pages.available.cache_clear()
