"""The C++ kernels compiled once, cached, and found again: ``python -m decoderlab.kernels.build`` (``make install``
runs it), or on the first product that needs them.

The files of ``csrc/`` compile side by side, each instruction set's file with its own flags (``-mavx2``...,
``-mavx512vnni``), the dispatching ``ops.cpp``, the fused decode step ``decode.cpp`` and the dequantizer
``dequant.cpp`` with the baseline's, and link into one shared library of ``torch.library`` ops (no Python
module: ``torch.ops.load_library`` loads it). Everything is keyed: the library lives in ``<cache>/kernels/<key>/``
where the key hashes the sources, the flags, the torch version and the compiler's ``--version`` -- an edited
source or another torch builds afresh, never a stale one. ``<cache>`` is ``$DECODERLAB_CACHE``, else
``$XDG_CACHE_HOME/decoderlab`` (``~/.cache/decoderlab``).

Two processes (pytest-xdist's workers, say) never compile at once: the build holds a file lock, and whoever waited
finds the library built. The build says on standard error what it did and how long it took. A failure (no
compiler, a compiler that lacks the flags) is one line on standard error, its output kept in a log beside it, and
the products use the portable torch path -- never a failed import. An instruction set's file that alone fails to
compile is left out (its CPUs use the next set).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
#: each source and its own flags; an instruction set's file, and the macro that leaves it out of ops.cpp
SOURCES = {
    "ops.cpp": ((), None),
    "decode.cpp": ((), None),
    "dequant.cpp": ((), None),
    "pack.cpp": ((), None),
    "isa_avx2.cpp": (("-mavx2", "-mfma", "-mf16c"), None),
    "isa_avxvnni.cpp": (("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), "DLK_NO_AVXVNNI"),
    "isa_avx512vnni.cpp": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma",
                            "-mf16c"), "DLK_NO_AVX512VNNI"),
    "isa_avx512bf16.cpp": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"),
                           "DLK_NO_AVX512BF16"),
    "isa_amx.cpp": (("-mamx-tile", "-mamx-bf16"), "DLK_NO_AMX"),
}
HEADERS = ("common.h", "products.h", "block_kernels.h", "dense_kernels.h", "quant_kernels.h", "sums512.h", "ymm_backend.h")
#: an instruction set file's name -> the set's name
SET_NAMES = {"isa_avx2.cpp": "avx2", "isa_avxvnni.cpp": "avx-vnni", "isa_avx512vnni.cpp": "avx512-vnni",
             "isa_avx512bf16.cpp": "avx512-bf16", "isa_amx.cpp": "amx-bf16"}
#: every file's flags: no contraction of a multiply and an add into an FMA that ggml's quantizers do not make
FLAGS = ("-O3", "-std=c++20", "-fPIC", "-ffp-contract=off", "-DNDEBUG", "-w")
LIBRARY = "decoderlab_kernels.so"
#: the files that include torch (the ops and their dispatch, at the baseline's flags)
TORCH_SOURCES = ("ops.cpp", "decode.cpp", "dequant.cpp", "pack.cpp")
#: the most seconds a process waits for another's build
LOCK_TIMEOUT = 900


def cache_dir() -> Path:
    """``$DECODERLAB_CACHE/kernels``, else ``$XDG_CACHE_HOME/decoderlab/kernels`` (``~/.cache/...``)."""
    root = os.environ.get("DECODERLAB_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "decoderlab"
    return Path(root) / "kernels"


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++``, ``g++`` or ``clang++`` on the PATH; None when there is none."""
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named) or named
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def unsupported() -> str | None:
    """Why the kernels cannot be built on this machine, or None when they can be tried."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    if sys.platform not in ("linux", "darwin"):
        return f"building on {sys.platform} is not supported"
    if compiler() is None:
        return "no C++ compiler found (set CXX)"
    return None


def fingerprint(cxx: str) -> str:
    """The cache key: the sources and headers, the flags, the torch version and the compiler's version."""
    import torch

    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = "?"
    h.update(repr((FLAGS, SOURCES, torch.__version__, version.splitlines()[:1], sys.platform)).encode())
    return h.hexdigest()[:16]


def _compile_commands(cxx: str, out: Path, left_out: tuple[str, ...], openmp: bool = True) -> dict[str, list]:
    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{p}" for p in include_paths("cpu")]
    commands = {}
    for name, (flags, _) in SOURCES.items():
        if name in left_out:
            continue
        extra = [*includes, *(["-fopenmp"] if openmp else []),
                 *(f"-D{SOURCES[n][1]}" for n in left_out)] if name in TORCH_SOURCES else []
        commands[name] = [cxx, *FLAGS, *flags, *extra, "-c", str(CSRC / name), "-o", str(out / f"{name}.o")]
    return commands


def _run_all(commands: dict[str, list], log) -> set[str]:
    """Run the compile commands side by side; the names of those that failed (their output written to log)."""
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    failed = set()
    for name, proc in procs.items():
        output, _ = proc.communicate()
        log.write(f"$ {' '.join(commands[name])}\n{output}\n")
        if proc.returncode:
            failed.add(name)
    return failed


def _compile(cxx: str, work: Path, log) -> list[str]:
    """Compile every source into ``work``; the instruction sets' files that compiled (ops.cpp again without those
    that did not). Raises RuntimeError when ops.cpp or the AVX2 file does not compile."""
    failed = _run_all(_compile_commands(cxx, work, ()), log)
    left_out = tuple(n for n in failed if SOURCES[n][1])
    broken = sorted(failed - set(left_out) - {"ops.cpp"})  # the AVX2 file or the fused decode step
    if broken:
        raise RuntimeError(f"{', '.join(broken)} did not compile")
    if left_out or "ops.cpp" in failed:
        # again without the files left out; then without OpenMP (ops.cpp's rows would run on one thread)
        tries = (True, False) if left_out else (False,)
        if all(_run_all({"ops.cpp": _compile_commands(cxx, work, left_out, omp)["ops.cpp"]}, log) for omp in tries):
            raise RuntimeError("ops.cpp did not compile")
    return [n for n in SOURCES if n not in left_out]


def _link(cxx: str, work: Path, compiled: list[str], log) -> Path:
    from torch.utils.cpp_extension import library_paths

    lib_dirs = library_paths("cpu")
    so = work / LIBRARY
    cmd = [cxx, "-shared", *(str(work / f"{n}.o") for n in compiled), "-o", str(so),
           *(f"-L{d}" for d in lib_dirs), *(f"-Wl,-rpath,{d}" for d in lib_dirs), "-lc10", "-ltorch_cpu", "-ltorch"]
    if sys.platform == "linux":
        cmd.append("-fopenmp")
    r = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}\n")
    if r.returncode:
        raise RuntimeError("the link failed")
    return so


def _build(cxx: str, target: Path) -> None:
    """Compile and link into ``target`` (written whole: a temporary file renamed), saying so on stderr."""
    print("decoderlab: compiling the CPU kernels (once; under a minute) ...", file=sys.stderr)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as tmp, \
            open(target.parent / "build.log", "w", encoding="utf-8") as log:
        work = Path(tmp)
        compiled = _compile(cxx, work, log)
        os.replace(_link(cxx, work, compiled, log), target)
    sets = [SET_NAMES[n] for n in compiled if n in SET_NAMES]
    print(f"decoderlab: compiled the CPU kernels ({', '.join(sets)}) in {time.perf_counter() - start:.1f} s; "
          f"cached in {target.parent}", file=sys.stderr)


def library(force: bool = False) -> tuple[Path | None, str]:
    """The kernels' shared library, built here first when it is not in the cache (or when ``force``): ``(path,
    "")``, or ``(None, why)`` where it cannot be built (the reason as one clause: no compiler, not x86-64, a
    compile error and where its log is)."""
    why = unsupported()
    if why:
        return None, why
    cxx = compiler()
    folder = cache_dir() / fingerprint(cxx)
    target = folder / LIBRARY
    if target.exists() and not force:
        return target, ""
    from filelock import FileLock, Timeout

    folder.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(folder / "build.lock"), timeout=LOCK_TIMEOUT):
            if force or not target.exists():  # another process may have built it while this one waited
                _build(cxx, target)
    except Timeout:
        return None, f"another process held the build lock {folder / 'build.lock'} for {LOCK_TIMEOUT} s"
    except (RuntimeError, OSError) as e:
        return None, f"the kernels did not compile: {e} (the compiler's output: {folder / 'build.log'})"
    return target, ""


def main(argv: list[str] | None = None) -> int:
    """``python -m decoderlab.kernels.build [--force]``: build (or find) the kernels, say where; exit 0 either
    way -- without them the products take the portable torch path."""
    args = sys.argv[1:] if argv is None else argv
    path, why = library(force="--force" in args)
    if path is None:
        print(f"decoderlab: no CPU kernels ({why}); products will use the portable torch path", file=sys.stderr)
    else:
        print(f"decoderlab: CPU kernels at {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
