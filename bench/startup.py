"""Start-up time of the command line: what a user waits for before anything happens.

In one run, alternating, the median wall time of:
    (a) python -c "pass" + building an argparse parser of eight subcommands (no torch): the floor for --help,
    (b) decoderlab --help, and decoderlab SUB --help for every command SUB,
    (c) python -c "import torch",
    (d) decoderlab generate on the trained statquest checkpoint (one answer of the lesson's model),
and the ratios (b)/(a) (target <= 1.3) and (d)/(c) (target <= 1.5).

The commands run as a user's would: with Python's bytecode cache (the package is byte-compiled first and
PYTHONDONTWRITEBYTECODE, which some sandboxes set, is removed from their environment); otherwise every start
would re-compile cli.py and friends (~10 ms).

    python bench/startup.py [--repeats 7] [--markdown]
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
FLOOR = "import argparse, sys; sys.argv=['decoderlab', '--help']\n" \
        "p = argparse.ArgumentParser(prog='decoderlab'); s = p.add_subparsers()\n" \
        "[s.add_parser(n, help=n).add_argument('--x' + str(i)) for i, n in enumerate('abcdefgh')]\n" \
        "p.format_help()"


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    import decoderlab

    compileall.compile_dir(str(Path(decoderlab.__file__).parent), quiet=1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(Path(tmp) / "statquest")
        subprocess.run([str(BIN / "decoderlab"), "train", "--preset", "statquest", "--out", ckpt], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from decoderlab.cli.parser import COMMANDS

        helps = {f"decoderlab {sub} --help".replace("  ", " "): [str(BIN / "decoderlab"), *sub.split(), "--help"]
                 for sub in ("", *COMMANDS)}
        cases = {
            "python + argparse (floor)": [sys.executable, "-c", FLOOR],
            **helps,
            'python -c "import torch"': [sys.executable, "-c", "import torch"],
            "decoderlab generate (statquest)": [str(BIN / "decoderlab"), "generate", "--checkpoint", ckpt,
                                                "what is statquest"],
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.repeats):  # alternate, so that load from other jobs hits every case alike
            for name, cmd in cases.items():
                times[name].append(timed(cmd))
    med = {k: statistics.median(v) for k, v in times.items()}
    floor, torch_ = "python + argparse (floor)", 'python -c "import torch"'
    against = {**{k: (floor, "vs floor (target <= 1.3)") for k in helps},
               "decoderlab generate (statquest)": (torch_, "vs import torch (target <= 1.5)")}
    print(f"| command | median wall s (of {args.repeats}) | ratio |")
    print("|---|---:|---|")
    for k in cases:
        r = f"{med[k] / med[against[k][0]]:.2f}x {against[k][1]}" if k in against else ""
        print(f"| {k} | {med[k]:.3f} | {r} |")


if __name__ == "__main__":
    main()
