"""SAELens parity of a saved SAE: ``sae_lens.SAE.load_from_disk`` opens a ``decoderlab sae`` directory and
encodes and decodes a batch of the model's own activations at the SAE's hook; the largest differences from
decoderlab's ``SparseAutoencoder`` are printed (target: <= 1e-5).

SAELens 6.x pins transformer-lens < 4 and decoderlab's tests use transformer-lens 4, so SAELens is not in
``dev``; install it beside, without touching the project's environment, and put it first on the path::

    pip install --no-deps --target /tmp/sl sae-lens==6.54.12 transformer-lens==3.9.0 plotly plotly-express \\
        simple-parsing python-dotenv babe py2store config2py dol i2 graze importlib_resources \\
        docstring_parser statsmodels patsy formulaic interface_meta wrapt better-abc narwhals
    PYTHONPATH=/tmp/sl python bench/sae_lens_parity.py runs/sae-x [--tokens 8192]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sae_dir")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    import sae_lens

    from decoderlab.dictionary.features import open_sae_run
    from decoderlab.glassbox.features import hook_activations

    opened = open_sae_run(args.sae_dir)
    windows = opened.held_out(args.tokens)[:, :-1]
    x = hook_activations(opened.model, windows, opened.hook).flatten(0, 1)
    print(f"sae_lens {sae_lens.__version__} on {args.sae_dir}: {x.shape[0]} activations at {opened.hook}")
    print("| dtype | what | max abs difference | max abs value | relative |")
    print("|---|---|---:|---:|---:|")
    for dtype in (torch.float32, torch.float64):
        ours = opened.sae.to(dtype)
        theirs = sae_lens.SAE.load_from_disk(args.sae_dir, dtype=str(dtype).removeprefix("torch."))
        xs = x.to(dtype)
        with torch.no_grad():
            f_ours, f_theirs = ours.encode(xs), theirs.encode(xs)
            rows = {"encode (features)": ((f_theirs - f_ours).abs().max(), f_ours.abs().max()),
                    "decode (our features)": ((theirs.decode(f_ours) - ours.decode(f_ours)).abs().max(),
                                              xs.abs().max()),
                    "forward (reconstruction)": ((theirs(xs) - ours(xs)).abs().max(), xs.abs().max())}
        for k, (v, m) in rows.items():
            print(f"| {str(dtype).removeprefix('torch.')} | {k} ({type(theirs).__name__}) | {float(v):.3g} | "
                  f"{float(m):.4g} | {float(v / m):.3g} |")


if __name__ == "__main__":
    main()
