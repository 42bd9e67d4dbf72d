"""The curves of a reinforcement-learning run, drawn from its history: mean reward, KL to the starting model,
reply length and end-of-turn rate per optimizer step, one PNG (matplotlib, imported when drawn)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Sequence

from ..files import atomic_write_bytes

#: (history key, panel title) of the four panels
PANELS = (("reward", "mean reward"), ("kl", "KL to the starting model (nats/token)"),
          ("reply_length", "reply length (tokens)"), ("end_of_turn_rate", "end-of-turn rate"))


def plot_history(history: Sequence[dict], path: str | os.PathLike, title: str = "reinforcement learning") -> Path:
    """Draw ``history`` (:attr:`decoderlab.reinforcement.grpo.RLModule.history`: one dict per step with ``step``,
    ``reward``, ``reward_std``, ``kl``, ``reply_length``, ``end_of_turn_rate``) as four panels against the step,
    the reward with a band of one standard deviation across the step's replies; write the PNG to ``path``
    atomically and return it.

    Raises:
        ValueError: an empty history.
    """
    if not history:
        raise ValueError("no steps to draw: the history is empty")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    steps = [h["step"] for h in history]
    fig = Figure(figsize=(9, 6), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).ravel()
    for ax, (key, label) in zip(axes, PANELS):
        values = [h[key] for h in history]
        ax.plot(steps, values, lw=1.2)
        if key == "reward":
            std = [h.get("reward_std", 0.0) for h in history]
            ax.fill_between(steps, [v - s for v, s in zip(values, std)], [v + s for v, s in zip(values, std)],
                            alpha=0.2, lw=0)
        if key == "end_of_turn_rate":
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[2:]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(title, fontsize=11)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path
