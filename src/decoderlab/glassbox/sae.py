"""Sparse autoencoders (SAEs) on a layer's activations: the TopK and the ReLU + L1 dictionaries, their losses,
dead-feature resampling, and SAELens's files.

An SAE maps an activation x (d_in = d_model for the residual stream) to d_sae non-negative feature
activations f and back to a reconstruction x̂:

    pre = (x - b_dec) @ W_enc + b_enc                        (..., d_sae)
    f   = TopK_k(pre) then ReLU   (architecture "topk")     or   ReLU(pre)   (architecture "standard")
    x̂   = f @ W_dec + b_dec                                  (..., d_in)

W_enc is (d_in, d_sae), W_dec (d_sae, d_in): row i of W_dec is feature i's direction in activation space, kept
at unit norm while training (so a feature's activation is the length it adds along that direction). The
names, shapes and orientation are SAELens's, and :meth:`SparseAutoencoder.save` writes SAELens's directory
(``cfg.json`` + ``sae_weights.safetensors``, and ``sparsity.safetensors``: log10 feature densities), which
``sae_lens.SAE.load_from_disk`` opens (architectures ``topk`` and ``standard``).

Sources: Bricken et al. 2023, "Towards Monosemanticity" (ReLU + L1, unit-norm decoder, resampling dead
neurons); Gao et al. 2024, "Scaling and evaluating sparse autoencoders" (TopK, the AuxK loss of dead latents);
SAELens (``TopKSAE``, ``StandardSAE``, their on-disk format).
"""

from __future__ import annotations

import json
import numbers
import os
from pathlib import Path

import torch
import torch.nn as nn

from ..hooks import hook_names, split_name

SAE_CFG_FILE = "cfg.json"
SAE_WEIGHTS_FILE = "sae_weights.safetensors"
SPARSITY_FILE = "sparsity.safetensors"
#: the SAELens version whose format the files follow (its 6.x ``cfg.json`` with ``metadata``)
SAE_LENS_FORMAT = "6.54.12"
ARCHITECTURES = ("topk", "standard")
#: the points an SAE can read: activations (B, T, d) -- and hook_z (B, T, H, d_head), flattened to H * d_head as
#: SAELens does (``reshape_activations="hook_z"``)
SAE_POINTS = ("hook_embed", "hook_pos_embed", "hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out",
              "hook_resid_post", "hook_normalized", "mlp.hook_pre", "mlp.hook_post", "attn.hook_z")


def sae_hook_names(model) -> list[str]:
    """The hook names of ``model`` an SAE can be trained on, in forward order (see :data:`SAE_POINTS`)."""
    return [n for n in hook_names(model)
            if split_name(n)[1] in SAE_POINTS or split_name(n)[1].endswith(".hook_normalized")]


def check_sae_hook(model, hook: str) -> str:
    """``hook`` when ``model`` has it and an SAE can read it; ``ValueError`` listing the valid names."""
    names = sae_hook_names(model)
    if hook not in names:
        has = hook in hook_names(model)
        why = "is not a point an SAE reads (patterns, scores, norms' scales, q/k/v)" if has else \
            "is not a hook point of this model"
        raise ValueError(f"hook {hook!r} {why}; valid hooks: {', '.join(names)}")
    return hook


def _positive_int(value, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer ({what}), got {value!r}")
    return int(value)


def check_sae_size(d_in: int, width, k=None) -> tuple[int, int | None]:
    """``(d_sae, k)`` of an SAE of ``width`` features per input dimension on ``d_in``: d_sae = width * d_in;
    ``k`` (None: the ReLU + L1 variant) must be 1 .. d_sae.

    Raises ``ValueError`` naming the value and the allowed range (0, negative, not an integer, k > d_sae)."""
    width = _positive_int(width, "width", "features per input dimension, e.g. 8")
    d_sae = width * int(d_in)
    if k is None:
        return d_sae, None
    k = _positive_int(k, "k", f"active features per token, 1 .. width x d_in = {d_sae}")
    if k > d_sae:
        raise ValueError(f"k must be at most the number of features width x d_in = {width} x {d_in} = {d_sae}, "
                         f"got {k}")
    return d_sae, k


def topk_relu(pre: torch.Tensor, k: int) -> torch.Tensor:
    """(..., d_sae) the ``k`` largest entries of ``pre`` per row through a ReLU, zeros elsewhere (SAELens's
    ``TopK``; Gao et al. 2024)."""
    values, index = torch.topk(pre, k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter_(-1, index, values.relu())


class SparseAutoencoder(nn.Module):
    """A TopK (``k`` given) or ReLU + L1 (``k=None``, SAELens's ``standard``) sparse autoencoder.

    Args:
        d_in: the activation's size (d_model for the residual stream; H * d_head for ``hook_z``).
        d_sae: the number of features.
        k: active features per token (TopK), or None for the ReLU variant.
        metadata: SAELens's ``metadata`` (``hook_name``, ``model_name``, ``context_size``, ...), kept as given.
        seed: the initialisation's seed: decoder rows random and unit norm, W_enc = W_decᵀ, biases zero.

    Parameters: W_enc (d_in, d_sae), b_enc (d_sae,), W_dec (d_sae, d_in), b_dec (d_in,).
    """

    def __init__(self, d_in: int, d_sae: int, k: int | None = None, *, metadata: dict | None = None,
                 seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.d_in, self.d_sae, self.k = int(d_in), int(d_sae), None if k is None else int(k)
        if self.k is not None:
            if not 1 <= self.k <= self.d_sae:
                raise ValueError(f"k must be 1 .. d_sae = {self.d_sae}, got {self.k}")
        self.metadata = dict(metadata or {})
        g = torch.Generator().manual_seed(int(seed))
        w_dec = torch.randn(self.d_sae, self.d_in, generator=g, dtype=torch.float64)
        w_dec = (w_dec / w_dec.norm(dim=1, keepdim=True)).to(dtype)
        self.W_dec = nn.Parameter(w_dec)
        self.W_enc = nn.Parameter(w_dec.T.clone().contiguous())
        self.b_enc = nn.Parameter(torch.zeros(self.d_sae, dtype=dtype))
        self.b_dec = nn.Parameter(torch.zeros(self.d_in, dtype=dtype))

    @property
    def architecture(self) -> str:
        return "standard" if self.k is None else "topk"

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_sae) ``(x - b_dec) @ W_enc + b_enc`` of x (..., d_in)."""
        return (x.to(self.W_enc.dtype) - self.b_dec) @ self.W_enc + self.b_enc

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """The features of pre-activations: TopK then ReLU, or ReLU."""
        return pre.relu() if self.k is None else topk_relu(pre, self.k)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_sae) feature activations (non-negative; at most k non-zero per row for TopK) of x (..., d_in)."""
        return self.activate(self.pre_activations(x))

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """(..., d_in) the reconstruction ``f @ W_dec + b_dec`` of features f (..., d_sae)."""
        return f @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) the reconstruction of x (..., d_in)."""
        return self.decode(self.encode(x))

    @torch.no_grad()
    def normalize_decoder_(self) -> None:
        """Every row of W_dec (a feature's direction) to unit norm, in place (Bricken et al. 2023)."""
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12))

    @torch.no_grad()
    def remove_parallel_grad_(self) -> None:
        """Drop the part of W_dec's gradient along each row, so a step moves a direction without lengthening it
        first (Bricken et al. 2023; followed by :meth:`normalize_decoder_`)."""
        if self.W_dec.grad is not None:
            w = self.W_dec / self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12)
            self.W_dec.grad.sub_((self.W_dec.grad * w).sum(dim=1, keepdim=True) * w)

    def cfg_dict(self) -> dict:
        """SAELens's ``cfg.json`` of this SAE (its 6.x fields)."""
        cfg = {"d_in": self.d_in, "d_sae": self.d_sae, "dtype": str(self.W_enc.dtype).removeprefix("torch."),
               "device": "cpu", "apply_b_dec_to_input": True, "normalize_activations": "none",
               "reshape_activations": "hook_z" if str(self.metadata.get("hook_name", "")).endswith("hook_z")
               else "none",
               "metadata": {"sae_lens_version": SAE_LENS_FORMAT, "sae_lens_training_version": SAE_LENS_FORMAT,
                            "hook_head_index": None, "prepend_bos": False, **self.metadata},
               "architecture": self.architecture}
        if self.k is not None:
            cfg.update(k=self.k, rescale_acts_by_decoder_norm=False)
        return cfg

    def save(self, directory: str | os.PathLike, log_sparsity: torch.Tensor | None = None) -> Path:
        """Write SAELens's directory: ``cfg.json``, ``sae_weights.safetensors`` (W_enc, b_enc, W_dec, b_dec) and,
        given (d_sae,) log10 feature densities, ``sparsity.safetensors``. Returns the directory."""
        from safetensors.torch import save_file

        from ..files import atomic_write_text

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {n: p.detach().cpu().contiguous() for n, p in self.named_parameters()}
        save_file(state, str(out / SAE_WEIGHTS_FILE))
        if log_sparsity is not None:
            save_file({"sparsity": log_sparsity.detach().cpu().float().contiguous()}, str(out / SPARSITY_FILE))
        atomic_write_text(out / SAE_CFG_FILE, json.dumps(self.cfg_dict(), indent=2))
        return out


#: what SAELens 6 keeps under ``metadata`` in cfg.json; before 6.0 these were top-level keys
METADATA_KEYS = ("model_name", "hook_name", "hook_head_index", "context_size", "prepend_bos", "dataset_path",
                 "model_class_name", "model_from_pretrained_kwargs", "seqpos_slice", "neuronpedia_id",
                 "sae_lens_training_version", "exclude_special_tokens", "hf_hook_name")
#: SAELens's key names before 6.0 -> their 6.x names
PRE_6_NAMES = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
               "activation_fn_str": "activation_fn"}


def _as_saelens_6(cfg: dict) -> tuple[dict, str]:
    """``(cfg, format)``: a cfg.json in SAELens 6's shape (``metadata`` holding the hook and the model; TopK as
    ``architecture: "topk"`` with ``k``), converted as SAELens 6 converts its earlier files
    (``handle_pre_6_0_config``), and the format's name for messages."""
    if isinstance(cfg.get("metadata"), dict):
        return cfg, f"SAELens {cfg['metadata'].get('sae_lens_version') or '6'}"
    old = {PRE_6_NAMES.get(k, k): v for k, v in cfg.items()}
    new = {k: v for k, v in old.items() if k not in METADATA_KEYS}
    new["metadata"] = {k: old[k] for k in METADATA_KEYS if k in old}
    norm = old.get("normalize_activations")
    new["normalize_activations"] = "none" if norm in (None, False) else \
        "expected_average_only_in" if norm is True else norm
    if old.get("architecture", "standard") == "topk" or old.get("activation_fn") == "topk":
        new["architecture"] = "topk"
        new["k"] = old.get("k", (old.get("activation_fn_kwargs") or {}).get("k"))
    version = old.get("sae_lens_training_version") or old.get("sae_lens_version")
    return new, f"SAELens {version} (before 6)" if version else "SAELens before 6"


def _read_cfg(path: Path) -> dict:
    cfg_file = path / SAE_CFG_FILE
    if not cfg_file.is_file() or not (path / SAE_WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{path} is not an SAE directory: it needs {SAE_CFG_FILE} and {SAE_WEIGHTS_FILE} "
                                f"(written by `decoderlab sae --out DIR` or SAELens's save_model)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    cfg, fmt = _as_saelens_6(cfg)
    where = f"{cfg_file} ({fmt})"
    arch = cfg.get("architecture", "standard")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: architecture {arch!r} is not one decoderlab reads; known: "
                         f"{', '.join(ARCHITECTURES)}")
    if cfg.get("normalize_activations", "none") != "none" or cfg.get("apply_b_dec_to_input", True) is not True \
            or cfg.get("rescale_acts_by_decoder_norm", False) or cfg.get("finetuning_scaling_factor", False):
        raise ValueError(f"{where}: normalize_activations other than 'none', apply_b_dec_to_input false, "
                         "rescale_acts_by_decoder_norm or finetuning_scaling_factor are not supported")
    if arch == "topk" and not isinstance(cfg.get("k"), int):
        raise ValueError(f"{where}: a topk SAE needs its k (k, or activation_fn_kwargs.k before 6)")
    return cfg


def sae_hook(sae: SparseAutoencoder, where=None) -> str:
    """The hook point ``sae`` was trained on (its ``metadata["hook_name"]``), for a reader that takes the hook from
    the SAE itself (``where``: its directory, named in the error; None for an SAE in memory).

    Raises:
        ValueError: the files name no hook (a cfg.json without ``metadata.hook_name``, SAELens 6, or
            ``hook_name`` / ``hook_point`` at its top level, earlier versions).
    """
    hook = sae.metadata.get("hook_name")
    if not hook and where is None:
        raise ValueError("the SAE names no hook point: its metadata has no hook_name")
    if not hook:
        raise ValueError(f"{Path(where) / SAE_CFG_FILE} names no hook point: SAELens 6 keeps it as metadata.hook_name, "
                         "earlier versions as hook_name (or hook_point) at the top level")
    return str(hook)


def load_sae(directory: str | os.PathLike) -> SparseAutoencoder:
    """The SAE of a SAELens directory (``cfg.json`` + ``sae_weights.safetensors``; architectures ``topk`` and
    ``standard``; the cfg.json of SAELens 6, or of an earlier version, read as SAELens 6 reads it), on the CPU in
    the stored dtype.

    Raises:
        FileNotFoundError: a missing file (naming it).
        ValueError: bad JSON, another architecture or normalisation, weights of the wrong names or shapes (each
            naming the file and its SAELens format).
    """
    from safetensors.torch import load_file

    path = Path(directory)
    cfg = _read_cfg(path)
    state = load_file(str(path / SAE_WEIGHTS_FILE))
    d_in, d_sae = int(cfg["d_in"]), int(cfg["d_sae"])
    want = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    got = {n: tuple(t.shape) for n, t in state.items()}
    if {n: got.get(n) for n in want} != want:
        raise ValueError(f"{path / SAE_WEIGHTS_FILE} holds {got}; an SAE of d_in={d_in}, d_sae={d_sae} needs {want}")
    k = cfg.get("k") if cfg.get("architecture", "standard") == "topk" else None
    sae = SparseAutoencoder(d_in, d_sae, k, metadata=cfg.get("metadata"), dtype=state["W_enc"].dtype)
    with torch.no_grad():
        for n in want:
            getattr(sae, n).copy_(state[n])
    return sae


def read_log_sparsity(directory: str | os.PathLike) -> torch.Tensor | None:
    """(d_sae,) the log10 feature densities saved beside an SAE, or None when it has none."""
    from safetensors.torch import load_file

    f = Path(directory) / SPARSITY_FILE
    return load_file(str(f))["sparsity"] if f.is_file() else None


# ---- training objectives -----------------------------------------------------------------------------------

def reconstruction_mse(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Squared error summed over the d_in dimensions, averaged over tokens (SAELens's training MSE)."""
    return (x_hat - x.to(x_hat.dtype)).pow(2).sum(dim=-1).mean()


def auxk_loss(sae: SparseAutoencoder, x: torch.Tensor, x_hat: torch.Tensor, pre: torch.Tensor,
              dead: torch.Tensor | None) -> torch.Tensor:
    """Gao et al. 2024's AuxK loss (as SAELens computes it): the top ``k_aux = d_in // 2`` dead latents'
    pre-activations decode (no bias) the residual ``x - x̂`` the live ones left; scaled by
    ``min(n_dead / k_aux, 1)``. Zero without dead latents. ``x``, ``x_hat`` (N, d_in); ``pre`` (N, d_sae);
    ``dead`` (d_sae,) bool."""
    n_dead = 0 if dead is None else int(dead.sum())
    if n_dead == 0:
        return x_hat.new_zeros(())
    k_aux = max(1, sae.d_in // 2)
    scale = min(n_dead / k_aux, 1.0)
    k_aux = min(k_aux, n_dead)
    masked = torch.where(dead[None], pre, torch.full_like(pre, -torch.inf))
    values, index = masked.topk(k_aux, dim=-1, sorted=False)
    acts = torch.zeros_like(pre).scatter_(-1, index, values)
    residual = (x.to(x_hat.dtype) - x_hat).detach()
    return scale * (acts @ sae.W_dec - residual).pow(2).sum(dim=-1).mean()


def sae_losses(sae: SparseAutoencoder, x: torch.Tensor, *, l1_coefficient: float = 0.0,
               dead: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The training losses of one batch x (N, d_in): ``mse`` (:func:`reconstruction_mse`); for the ReLU
    variant ``l1`` = l1_coefficient x mean over tokens of sum_i f_i ||W_dec[i]|| (SAELens's ``standard``);
    for TopK ``auxk`` (:func:`auxk_loss`); ``loss`` their sum; ``features`` (N, d_sae) detached."""
    pre = sae.pre_activations(x)
    f = sae.activate(pre)
    x_hat = sae.decode(f)
    out = {"mse": reconstruction_mse(x, x_hat)}
    if sae.k is None:
        out["l1"] = l1_coefficient * (f * sae.W_dec.norm(dim=1)).sum(dim=-1).mean()
    else:
        out["auxk"] = auxk_loss(sae, x, x_hat, pre, dead)
    out["loss"] = sum(out.values())
    out["features"] = f.detach()
    return out


@torch.no_grad()
def resample_dead(sae: SparseAutoencoder, x: torch.Tensor, dead: torch.Tensor, *, seed: int = 0,
                  encoder_scale: float = 0.2) -> int:
    """Bricken et al. 2023's resampling, in place: each dead feature's decoder row becomes the (unit) direction
    of an input the SAE reconstructs badly (drawn with probability proportional to its squared error, from x
    (N, d_in)), its encoder column that direction times ``encoder_scale`` x the mean norm of the live
    features' encoder columns, its encoder bias 0. Returns the number resampled (the caller resets the
    optimizer's moments of those rows)."""
    index = dead.nonzero().flatten()
    if index.numel() == 0:
        return 0
    x = x.to(sae.W_enc.dtype)
    err = (sae(x) - x).pow(2).sum(dim=-1)
    g = torch.Generator(device=x.device).manual_seed(int(seed))
    weights = err if float(err.sum()) > 0 else torch.ones_like(err)
    picks = torch.multinomial(weights, index.numel(), replacement=index.numel() > x.size(0), generator=g)
    directions = x[picks] - sae.b_dec
    directions = directions / directions.norm(dim=1, keepdim=True).clamp_min(1e-12)
    live = ~dead
    enc_norm = sae.W_enc[:, live].norm(dim=0).mean() if bool(live.any()) else torch.tensor(1.0)
    sae.W_dec[index] = directions
    sae.W_enc[:, index] = directions.T * encoder_scale * enc_norm
    sae.b_enc[index] = 0.0
    return int(index.numel())
