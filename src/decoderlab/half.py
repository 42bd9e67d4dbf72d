"""16-bit weights with float32 activations: a GGUF file's F16 / BF16 matrices kept in their 16 bits, the model's
activations, norms and caches float32 -- as llama.cpp runs an F16 or BF16 file.

A model cast to bfloat16 computes every activation in bfloat16 too, which a CPU without AVX512-BF16 emulates in
float32 conversions: SmolLM2-135M's F16 file decoded at 4.9 tok/s that way, against 8.0 for its float32 copy (1
thread, AMD EPYC AVX2). Held here, a matrix's product is the kernels' ``dense_linear`` (:mod:`decoderlab.kernels`:
the weight widened to float32 exactly in registers, a bfloat16 weight's activations rounded to bfloat16 as ggml's)
and the model reads half the bytes of float32 per token.

:class:`HalfLinear` is an ``nn.Linear`` whose weight may be 16-bit while its input is float32:

* few rows (a decode step: at most :data:`KERNEL_ROWS`), no gradient asked, on the CPU: ``dense_linear``;
* more rows (a prompt) or a gradient (LoRA over the frozen 16-bit base): ``F.linear`` on the weight widened a
  slice of rows at a time (:data:`_SLICE`: no float32 copy of a large matrix is kept, and the slices' gradients
  flow to the input);
* an input of the weight's own dtype (the model cast whole, ``model.double()`` for the float64 reference): plain
  ``F.linear``.

:class:`HalfEmbedding` is an ``nn.Embedding`` whose rows come out in the model's float dtype (float32, or what the
model was cast to), so a tied output layer and embedding share one 16-bit matrix. :func:`use_half_weights` puts
them in place of a loaded model's 16-bit layers (the GGUF loader's ``--dtype auto`` for a float file).

Source: ggml's F16 / BF16 ``vec_dot`` (github.com/ggml-org/llama.cpp, ``ggml-cpu``), whose type traits pair a BF16
weight with BF16 activations and an F16 weight with F16 ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

#: the 16-bit dtypes a layer here holds
HALF = (torch.float16, torch.bfloat16)
#: the most rows of ``x`` a product takes through ``dense_linear``; more take widened slices and ``F.linear``
#: (a GEMM's blocking). Measured: SmolLM2-135M's 128-token prompt, 1 thread, AMD EPYC AVX2, alternating rounds
#: (2026-12-07): widened slices 222 / 236 tok/s (f16 / bf16 file), every row through dense_linear 157 / 143
KERNEL_ROWS = 16
#: weights widened to float32 at a time for ``F.linear`` (4 MB of float32: SmolLM2's matrices whole, its output
#: layer in slices; no float32 copy of a large matrix is kept). Measured: the 210 products of a 128-token prompt
#: over SmolLM2's float16 weights, 1 thread, AMD EPYC AVX-512 (2026-12-07), alternating: 311 ms at 4 MB slices,
#: 311 ms widening each matrix whole, 398 ms at 512 KB (L2-sized: more, smaller GEMMs, each packing its slice)
_SLICE = 1 << 20


def _kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x``'s product goes through ``dense_linear``: float32 on the CPU, no gradient asked, at most
    :data:`KERNEL_ROWS` rows (a compiled graph's symbolic row count counts as few: a comparison would guard) --
    or any number of rows of a bfloat16 weight where the kernels multiply bfloat16 pairs (AVX512-BF16's
    vdpbf16ps, four weight rows a pass: SmolLM2's 128-row products 1.0x llama.cpp's, against 0.5-0.6x for the
    widened slices' F.linear on an AVX-512 EPYC, 2026-12-07; AMX's tiles on a Xeon that has them)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or (torch.is_grad_enabled() and x.requires_grad):
        return False
    rows = x.shape[:-1].numel()
    if not isinstance(rows, int) or rows <= KERNEL_ROWS:
        return True
    return weight.dtype == torch.bfloat16 and kernels.isa() in kernels.BF16_PAIRS


def widened_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` by ``F.linear`` on ``weight`` (out, in) widened to ``x``'s dtype a slice of rows at a time (no
    whole widened copy); (..., in) -> (..., out), differentiable in ``x`` (and in ``weight``)."""
    rows = max(1, _SLICE // max(1, weight.shape[1]))
    parts = [F.linear(x, weight[s:s + rows].to(x.dtype)) for s in range(0, weight.shape[0], rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class HalfLinear(nn.Linear):
    """``nn.Linear`` (..., in_features) -> (..., out_features) over a float16 / bfloat16 weight, for float32 inputs
    (module docstring); its bias, if any, float32. Raises what ``F.linear`` raises for other mismatches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype:
            return F.linear(x, w, self.bias)
        y = kernels.dense_linear(x, w) if _kernel(x, w) else widened_linear(x, w)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class HalfEmbedding(nn.Embedding):
    """``nn.Embedding`` ids (...) -> (..., embedding_dim) over a 16-bit weight, its rows widened to
    :attr:`out_dtype`: float32, or the float dtype the model was last cast to (``.double()``, ``.to(dtype)``)."""

    out_dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.out_dtype)

    def _apply(self, fn, recurse=True):
        probe = fn(torch.empty(0, dtype=self.out_dtype))
        if probe.dtype.is_floating_point:
            self.out_dtype = probe.dtype
        return super()._apply(fn, recurse)


def _swap(module: nn.Module, cls) -> nn.Module:
    """``module`` (an ``nn.Linear`` / ``nn.Embedding``) as ``cls``, sharing its parameters, hooks and all."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    return new


def use_half_weights(model: nn.Module) -> int:
    """Make every ``nn.Linear`` / ``nn.Embedding`` of ``model`` whose weight is float16 / bfloat16 a
    :class:`HalfLinear` / :class:`HalfEmbedding` over the same parameters, and every other floating parameter
    and buffer float32 (norms, biases, rotary tables): a float32 model whose matrices stay in 16 bits. Returns
    how many layers it made."""
    made = 0
    for name, module in list(model.named_modules()):
        if type(module) in (nn.Linear, nn.Embedding) and module.weight.dtype in HALF:
            new = _swap(module, HalfLinear if type(module) is nn.Linear else HalfEmbedding)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            made += 1
    halves = {id(m.weight) for m in model.modules() if isinstance(m, (HalfLinear, HalfEmbedding))}
    with torch.no_grad():
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and p.is_floating_point() and p.dtype != torch.float32 and id(p) not in halves:
                    module._parameters[key] = nn.Parameter(p.float(), requires_grad=p.requires_grad)
            for key, b in list(module._buffers.items()):
                if b is not None and b.is_floating_point() and b.dtype != torch.float32:
                    module._buffers[key] = b.float()
    return made


def half_dtype(model: nn.Module) -> torch.dtype | None:
    """The 16-bit dtype of ``model``'s :class:`HalfLinear` weights (the first met), None if it has none."""
    for m in model.modules():
        if isinstance(m, HalfLinear) and m.weight.dtype in HALF:
            return m.weight.dtype
    return None
