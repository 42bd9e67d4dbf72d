"""An ahead-of-time compiled decode step: ``torch.export`` + AOTInductor, packaged once on disk as a ``.pt2``
and loaded in any later process (``DecoderOnlyTransformer.compile_decode(mode="aot")``, ``generate --aot``).

The step is :meth:`DecoderOnlyTransformer.decode` over a static KV cache (``KVCache(static=True)``, the cache a
compiled step decodes over): its inputs are tensors -- the new tokens (B, 1), the positions ((1,) for rows
without padding, (B, 1) with), the column the step writes (1,), a window whose length (the one size that varies,
symbolic in the compiled code) is the number of columns written so far, this step's included, every layer's
keys and values (B, n_kv_head, max_len, d_head), and for a padded batch the (B, max_len) padding mask; attention
reads the window's columns only, not the whole capacity -- and it writes the new
keys/values into the cache's buffers in place (the exported program's input mutations, which AOTInductor
keeps). ``torch.export`` traces it into one graph, ``torch._inductor.aoti_compile_and_package`` compiles that
graph into a ``.pt2`` package (generated C++ and its shared library: no Python between the kernels, and none of
dynamo's guards at each call), and ``torch._inductor.aoti_load_package`` loads it in a fraction of a second.

The package holds code, not weights: it is compiled with its constants left out
(``aot_inductor.package_constants_in_so=False``) and, once loaded, reads the model's own parameter tensors
(``load_constants(..., user_managed=True)``). So a package serves every model of one shape and dtype -- a
fine-tuned checkpoint reuses its base's --, the process holds one copy of the weights, and a weight changed in
place (an optimizer step, ``load_state_dict``) is decoded with at once. A parameter *replaced* by another tensor
(``model.to(dtype)``, ``load_state_dict(assign=True)``) is noticed at the next step, which then finds (or
compiles) the package for the new tensors.

One package per kind of call: the batch size B and whether rows are padded (``generate`` is B = 1 unpadded;
``generate_batch`` of prompts of different lengths is padded). Each is compiled the first time that kind is
called and written to ``cache_dir`` (default ``$DECODERLAB_CACHE/aot``, else ``~/.cache/decoderlab/aot``) under
a name made from everything the compiled code depends on: the model's config, every tensor's name, dtype and
shape, the device, the kind, torch's version, the CPU's instruction set and the source of the modules the step
runs. A later process with a
model of the same shape finds it there and loads it without compiling. Each compile's time is kept there too
(``waits.json``), so that the next compile says how long it should take on this machine. A cache that is not
static (the server's batch cache, whose shapes grow) and an int position are decoded eagerly by ``model.decode``.

Source: PyTorch's AOTInductor (``torch._inductor.aoti_compile_and_package``, torch >= 2.6; weights kept out of
the package and loaded as user-managed constants: tested with torch 2.13).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch._inductor  # (aoti_compile_and_package, aoti_load_package)
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import quant
from .attention import KVCache
from .waiting import Heartbeat, MeasuredWaits, cache_root, starting


def default_cache_dir() -> Path:
    """``$DECODERLAB_CACHE/aot``, else ``$XDG_CACHE_HOME/decoderlab/aot`` (``~/.cache/decoderlab/aot``)."""
    return cache_root() / "aot"


class _StepGraph(nn.Module):
    """What is exported: ``model.decode`` with the static cache rebuilt from its tensors, so that the graph's
    inputs are tensors only (the cache's buffers mutated in place). ``window``'s length -- symbolic in the
    exported graph -- is how many leading cache columns the step reads: the written ones, not the capacity."""

    def __init__(self, model, masked: bool):
        super().__init__()
        self.model, self.masked = model, masked

    def forward(self, tokens, positions, column, window, *tensors):
        kv, mask = (tensors[:-1], tensors[-1]) if self.masked else (tensors, None)
        cfg = self.model.config
        cache = KVCache(cfg.n_layer, cfg.max_len)  # the engine's static cache, over the given buffers
        cache.static, cache.column, cache.window = True, column, window.size(0)
        cache._columns = torch.arange(cfg.max_len, device=column.device)
        for i, layer in enumerate(cache.layers):
            layer.k, layer.v = kv[2 * i], kv[2 * i + 1]
        return self.model.decode(tokens, positions, mask, cache)


def _fingerprint(model, kind: tuple[int, bool]) -> str:
    """sha256 of what the compiled package depends on (see the module docstring): not the weights' values, but
    every tensor's name, dtype and shape."""
    from . import attention, matvec, positions, quant

    h = hashlib.sha256()
    p = next(model.parameters())
    # every tensor's name, dtype and shape: a model whose layers hold different block types (a GGUF file's Q4_1
    # matrices beside a Q8_0 one) must not load the package of another mix
    tensors = [(name, str(t.dtype), list(t.shape)) for name, t in model.state_dict().items()]
    h.update(json.dumps({"config": model.config.to_dict(), "tensors": tensors, "device": str(p.device),
                         "kind": list(kind), "torch": torch.__version__,
                         "isa": torch.backends.cpu.get_cpu_capability()}, sort_keys=True, default=str).encode())
    for mod in (sys.modules[type(model).__module__], sys.modules[__name__], attention, matvec, positions, quant):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _tensor_slots(graph: nn.Module) -> dict[str, tuple[dict, str, torch.Tensor]]:
    """Every parameter and buffer of ``graph`` by its name (tied ones under each of their names): the dict that
    holds it, its key there and the tensor, so that a replaced tensor can be noticed cheaply."""
    slots = {}
    for prefix, mod in graph.named_modules(remove_duplicate=False):
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is not None:
                    slots[f"{prefix}.{name}" if prefix else name] = (store, name, t)
    return slots


def _load(path: Path):
    """The package at ``path`` loaded, or None when it cannot be (a damaged file: it is then removed). The kernels'
    ops are made to exist first: a step over block weights calls ``torch.ops.decoderlab.block_linear`` by name,
    which must be registered in this process before the package runs (measured: SmolLM2-135M's q4_1 step compiled
    with the op in 304 s on 2 loaded cores, and decodes eager's greedy tokens)."""
    from . import kernels

    kernels.load()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (torch.jit's, raised inside torch's loader)
            return torch._inductor.aoti_load_package(str(path))
    except RuntimeError:
        path.unlink(missing_ok=True)
        return None


class AOTDecodeStep:
    """``model.decode`` as AOTInductor packages, one per kind of call (see the module docstring); called as
    ``model.decode(tokens, positions, padding_mask, cache)`` is, returning the (B, num_tokens) logits.

    ``compile_missing=False``: a kind whose package is not on disk is decoded eagerly (``model.decode``) instead
    of compiled -- what ``generate`` does by default, fast when a package is cached and never waiting for a
    compiler otherwise. ``notify``: called with one line when a compile starts
    (``"compiling the decode step ahead of time ..."``, with the time it should take where this machine measured
    an earlier compile of the kind, :mod:`decoderlab.waiting`), every ``waiting.EVERY`` seconds while it runs,
    and when it is done, with its time, so that a caller can say why the first token waits.

    Attributes:
        cache_dir: where the packages are written and found.
        packages: kind (B, padded) -> the ``.pt2`` path of each kind loaded so far.
        compile_seconds: kind -> seconds spent exporting and compiling it in this process (0.0 when the package
            was on disk already), so that a caller can report the compile cost once.

    Raises:
        ValueError: the model's weights are tensor subclasses (torchao's quantized tensors, say).
        RuntimeError: a compiled package asks for a constant the model does not hold (a weight computed at compile
            time, which a package without its weights cannot carry).
    """

    #: attention reads the window's columns, all written: the engine's static cache need not start as zeros
    reads_written_only = True

    def __init__(self, model, cache_dir: str | os.PathLike | None = None, *, compile_missing: bool = True,
                 notify=None):
        if any(is_traceable_wrapper_subclass(p) for p in model.parameters()):
            # (torch.export flattens such a weight into parts the package would read by other names)
            raise ValueError("the ahead-of-time decode step takes plain weights (float32, bfloat16, float16, or "
                             "q8_0 / q4_0 / q4_1 blocks), not tensor subclasses: decode those eagerly or with "
                             "compile_decode() (--compile)")
        self.model = model
        self.compile_missing, self.notify = compile_missing, notify
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.packages: dict[tuple[int, bool], Path] = {}
        self.compile_seconds: dict[tuple[int, bool], float] = {}
        self._runners: dict[tuple[int, bool], object] = {}
        self._slots: dict[str, tuple[dict, str, torch.Tensor]] = {}  # the tensors the loaded runners read
        self._window: torch.Tensor | None = None  # a buffer whose leading slices carry the window's length

    def __call__(self, tokens, positions, padding_mask, cache):
        if not getattr(cache, "static", False) or not isinstance(positions, torch.Tensor):
            return self.model.decode(tokens, positions, padding_mask, cache)
        if not all(store.get(name) is t for store, name, t in self._slots.values()):
            # a parameter was replaced: the runners read the old tensors (kept alive till now); load them again
            self._runners, self._slots = {}, {}
        kind = (tokens.size(0), padding_mask is not None)
        if self._window is None or self._window.device != tokens.device:
            self._window = torch.empty(self.model.config.max_len, dtype=torch.uint8, device=tokens.device)
        window = self._window[: max(2, cache.length + 1)]  # its length: the columns written, this step's included
        args = (tokens, positions, cache.column, window, *[t for lay in cache.layers for t in (lay.k, lay.v)],
                *(() if padding_mask is None else (padding_mask.to(torch.bool),)))
        runner = self._runners.get(kind)
        if runner is None:
            if not self.compile_missing and not self.has_package(kind):
                return self.model.decode(tokens, positions, padding_mask, cache)
            runner = self._runners[kind] = self._package(kind, args)
        return runner(*args)

    def package_path(self, kind: tuple[int, bool]) -> Path:
        """Where the package of ``kind`` (batch size, padded) for this model is kept."""
        padded = "-padded" if kind[1] else ""
        return self.cache_dir / f"decode-b{kind[0]}{padded}-{_fingerprint(self.model, kind)[:24]}.pt2"

    def has_package(self, kind: tuple[int, bool]) -> bool:
        """Whether the package of ``kind`` is loaded or on disk (loading it then compiles nothing)."""
        return kind in self._runners or self.package_path(kind).exists()

    def _package(self, kind: tuple[int, bool], args: tuple):
        """The loaded package of ``kind``, reading the model's tensors: from ``cache_dir`` when there, else
        exported, compiled and written."""
        path = self.package_path(kind)
        self.compile_seconds.setdefault(kind, 0.0)  # (a package loaded again after a replaced weight adds nothing)
        runner = _load(path) if path.exists() else None
        if runner is None:  # not there, or unreadable (a partial copy, a full disk): compiled in its place
            self.compile_seconds[kind] += self._compile_said(kind, args, path)
            runner = _load(path)
            if runner is None:
                raise RuntimeError(f"the AOT package {path} compiled just now cannot be loaded")
        self.packages[kind] = path
        slots = _tensor_slots(_StepGraph(self.model, kind[1]))
        wanted = runner.get_constant_fqns()
        missing = [name for name in wanted if name not in slots]
        if missing:
            raise RuntimeError(f"the AOT package {path.name} needs constants the model does not hold: "
                               f"{', '.join(missing[:5])}")
        # the runner keeps the tensors' addresses, not the tensors: self._slots keeps them alive
        runner.load_constants({name: slots[name][2] for name in wanted}, check_full_update=True, user_managed=True)
        self._slots.update({name: slots[name] for name in wanted})
        return runner

    def _compile_said(self, kind: tuple[int, bool], args: tuple, path: Path) -> float:
        """:meth:`_compile`, said through ``notify``: when it starts (with the time it should take where this
        machine measured one: :class:`decoderlab.waiting.MeasuredWaits`, kept in ``cache_dir``), every
        ``waiting.EVERY`` seconds while it runs, and when it is done, with its time, which is recorded for the next
        compile. Returns its seconds."""
        padded = ", padded" if kind[1] else ""
        doing = f"compiling the decode step ahead of time for {kind[0]} row(s){padded}"
        p = next(self.model.parameters())
        dtype = quant.block_dtype(self.model) or str(p.dtype).removeprefix("torch.")
        waits, what, size = MeasuredWaits(self.cache_dir / "waits.json"), f"aot compile, {p.device.type}, {dtype}", \
            self.model.config.n_layer
        estimate = waits.estimate(what, path.stem, size)
        say = self.notify or (lambda line: None)
        say(starting(f"{doing}, once for this model's shape and dtype", estimate))
        with Heartbeat(doing, say, expected=None if estimate is None else estimate.seconds) as beat:
            self._compile(kind, args, path)
        waits.record(what, path.stem, size, beat.seconds)
        say(f"compiled the decode step ahead of time in {beat.seconds:.0f} s: {path} (later runs load it)")
        return beat.seconds

    def _compile(self, kind: tuple[int, bool], args: tuple, path: Path) -> None:
        """Export the step for ``args``' shapes and compile it, without its weights, into ``path`` (written under a
        temporary name in the same folder, then renamed: a process that stops midway leaves no half package)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            # traced on copies, outside inference mode: torch.export cannot record the in-place cache writes on
            # the engine's inference tensors; only their shapes matter here
            args = tuple(a.clone() for a in args)
            warnings.simplefilter("ignore", FutureWarning)  # (torch's own deprecation notices, raised inside torch)
            warnings.simplefilter("ignore", DeprecationWarning)
            # the window's length is the one symbolic size (at least 2: a step follows a prefill of >= 1 token)
            window = torch.export.Dim("window", min=2, max=self.model.config.max_len)
            dynamic = (None, None, None, {0: window}, tuple(None for _ in args[4:]))  # (forward's *tensors: one)
            program = torch.export.export(_StepGraph(self.model, kind[1]), args, dynamic_shapes=dynamic,
                                          strict=False)
            configs = {"aot_inductor.package_constants_in_so": False}
            if quant.block_dtype(self.model) and args[0].device.type == "cpu":
                configs.update(quant.FAST_CONTRACT)
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=configs)
        os.replace(tmp, path)
