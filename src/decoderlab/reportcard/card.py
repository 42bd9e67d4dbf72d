"""The card's numbers and tables, computed from ``card.json``'s per-question outcomes alone (so anyone can
recompute them): greedy accuracy with its Wilson interval, every stage-to-stage difference with its paired
interval (marked ``*`` when the interval excludes 0), sampled pass@1 and pass@k beside a uniform guess's
pass@k, the room RL has on each row, the work checked, the calculator's columns and the behaviour rows.
"""

from __future__ import annotations

from .stats import PairedTable, guess_pass_at_k, paired_bootstrap, paired_interval, pass_at_k, wilson

#: the stage pairs whose differences the card shows (second minus first), where both stages are present
PAIRS = (("base", "sft"), ("sft", "control"), ("sft", "rl"), ("control", "rl"))
#: the mark of a difference whose 95% interval excludes 0
MARK = " *"


def accuracy(right: list[int]) -> tuple[float, float, float]:
    """``(accuracy, low, high)``: the share right and its Wilson 95% interval."""
    lo, hi = wilson(sum(right), len(right))
    return sum(right) / len(right), lo, hi


def difference(first: list[int], second: list[int]) -> tuple[float, float, float]:
    """``(second - first, low, high)`` on the same questions: Newcombe's paired 95% interval."""
    return paired_interval(PairedTable.of(first, second))


def pass_rates(sample_right: list[int], samples: int, k: int) -> tuple[list[float], list[float]]:
    """Per question: sampled pass@1 (the share of its samples right) and pass@k (Chen et al.'s estimator)."""
    k = min(k, samples)
    return [c / samples for c in sample_right], [pass_at_k(samples, c, k) for c in sample_right]


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def row_numbers(card: dict, label: str, k: int) -> dict:
    """Every number of one row: per stage ``{"greedy": (acc, lo, hi), "pass1", "passk", "work_true",
    "false_lines", "calc": (acc, lo, hi) or None}``, per pair ``{"greedy": (d, lo, hi), "pass1": (d, lo, hi)
    or None}``, and ``guess_passk`` and ``room`` (pass@k above both pass@1 and a guess's pass@k, per stage)."""
    row = next(r for r in card["rows"] if r["label"] == label)
    samples = card["samples"]
    out = {"n": row["n"], "guess_passk": mean(guess_pass_at_k(p, k) for p in row["chance"]), "stages": {}, "pairs": {}}
    for stage in card["stages"]:
        s = card["scores"][stage][label]
        off, on = s["off"], s["on"]
        nums = {"greedy": accuracy(off["right"]), "pass1": None, "passk": None, "room": None, "calc": None,
                "work_true": None, "false_lines": None}
        if "sample_right" in off:
            p1, pk = pass_rates(off["sample_right"], samples, k)
            nums.update(pass1=mean(p1), passk=mean(pk), room=mean(pk) - max(mean(p1), out["guess_passk"]))
        work = [f for f in off["false_lines"] if f is not None]
        if work:
            nums.update(work_true=mean(f == 0 for f in work), false_lines=sum(work))
        if on is not None:
            nums["calc"] = accuracy(on["right"])
        out["stages"][stage] = nums
    for first, second in PAIRS:
        if first in card["stages"] and second in card["stages"]:
            a, b = card["scores"][first][label]["off"], card["scores"][second][label]["off"]
            pair = {"greedy": difference(a["right"], b["right"]), "pass1": None}
            if "sample_right" in a and "sample_right" in b:
                pair["pass1"] = paired_bootstrap(pass_rates(a["sample_right"], samples, 1)[0],
                                                 pass_rates(b["sample_right"], samples, 1)[0])
            out["pairs"][f"{second} - {first}"] = pair
    return out


def numbers(card: dict, k: int | None = None) -> dict:
    """:func:`row_numbers` of every row (``k``: pass@k's k, default the card's samples)."""
    k = k or card["samples"] or 1
    return {r["label"]: row_numbers(card, r["label"], k) for r in card["rows"]}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _interval(t) -> str:
    return "-" if t is None else f"{100 * t[0]:.0f}% [{100 * t[1]:.0f}, {100 * t[2]:.0f}]"


def _points(t) -> str:
    if t is None:
        return "-"
    d, lo, hi = t
    mark = MARK if lo > 0 or hi < 0 else ""
    return f"{100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]{mark}"


def _table(title: str, header: list[str], rows: list[list[str]], note: str = "") -> list[str]:
    out = [f"### {title}", ""] + ([note, ""] if note else [])
    out += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return out + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def tables(card: dict, nums: dict) -> list[str]:
    """The card's markdown tables (greedy; differences; sampled; work; calculator)."""
    stages, k = card["stages"], card["samples"]
    chat = [s for s in stages if s != "base"]
    labels = [r["label"] for r in card["rows"]]
    lines = _table("Greedy accuracy, calculator off (95% Wilson interval)", ["task", "n"] + stages,
                   [[lb, str(nums[lb]["n"])] + [_interval(nums[lb]["stages"][s]["greedy"]) for s in stages]
                    for lb in labels])
    pairs = [p for p in nums[labels[0]]["pairs"]]
    lines += _table("Stage against stage: greedy accuracy, points (paired 95% interval, Newcombe; * excludes 0)",
                    ["task"] + pairs, [[lb] + [_points(nums[lb]["pairs"][p]["greedy"]) for p in pairs]
                                       for lb in labels])
    if k and chat:
        head = ["task", f"guess pass@{k}"] + [f"{s} pass@1 / pass@{k}" for s in chat] + ["room (sft)"]
        rows = [[lb, _pct(nums[lb]["guess_passk"])]
                + [f"{_pct(nums[lb]['stages'][s]['pass1'])} / {_pct(nums[lb]['stages'][s]['passk'])}" for s in chat]
                + [_pct(nums[lb]["stages"].get("sft", {}).get("room"))] for lb in labels]
        lines += _table(f"Sampled at temperature 1: pass@1 and pass@{k} ({k} replies per question)", head, rows,
                        f"pass@{k} by Chen et al.'s unbiased estimator; guess: a uniform guess over the question's "
                        f"possible answers, {k} tries; room: pass@{k} above both pass@1 and the guess's pass@{k}.")
        sampled = [p for p in pairs if nums[labels[0]]["pairs"][p]["pass1"] is not None]
        lines += _table("Stage against stage: sampled pass@1, points (paired bootstrap 95% interval; * excludes 0)",
                        ["task"] + sampled, [[lb] + [_points(nums[lb]["pairs"][p]["pass1"]) for p in sampled]
                                             for lb in labels])
    work = [lb for lb in labels if any(nums[lb]["stages"][s]["work_true"] is not None for s in chat)]
    if work and chat:
        lines += _table("Work checked: greedy replies whose every line is true (false lines in all)", ["task"] + chat,
                        [[lb] + [f"{_pct(nums[lb]['stages'][s]['work_true'])} ({nums[lb]['stages'][s]['false_lines']})"
                                 for s in chat] for lb in work])
    calc = [s for s in chat if nums[labels[0]]["stages"][s]["calc"] is not None]
    if calc:
        lines += _table("Calculator on (the calls run, their results fed back)", ["task"] + [s + " +calc" for s in calc],
                        [[lb] + [_interval(nums[lb]["stages"][s]["calc"]) for s in calc] for lb in labels])
    return lines


def behaviour(card: dict) -> list[str]:
    """The turn-ended rate (calculator off), the calls on questions the model answers itself and the call's
    expression on tool rows (calculator on), and the plain chat turn."""
    chat = [s for s in card["stages"] if s != "base"]
    if not chat:
        return []
    tool_rows = {r["label"] for r in card["rows"] if r["needs_tool"]}

    def share(stage, key, rows, side="off"):
        vals = [v for lb, s in card["scores"][stage].items() if lb in rows and s[side] is not None for v in s[side][key]]
        return mean(vals) if vals else None

    mine = {r["label"] for r in card["rows"]} - tool_rows
    rows = [["turn ended (calculator off, all rows)"] + [_pct(share(s, "ended", mine | tool_rows)) for s in chat],
            ["no tool call on self-answerable rows (calculator on)"]
            + [_pct(None if share(s, "called", mine, "on") is None else 1 - share(s, "called", mine, "on"))
               for s in chat],
            ["the call's expression right on tool rows (calculator on)"]
            + [_pct(share(s, "expression_right", tool_rows, "on")) for s in chat],
            ["story prompt answered with text"]
            + [("yes" if card["story"][s]["text"] else "no") if card["story"].get(s) else "-" for s in chat]]
    return _table("Behaviour", [""] + chat, rows)


def markdown(card: dict, name: str) -> str:
    """The whole card as markdown (``report.md``)."""
    nums = numbers(card)
    k = card["samples"]
    lines = [f"# Report card: {name}", "",
             f"Held-out questions ({card['questions']} per row, fewer where the held-out split has fewer: n), the "
             f"same for every stage; greedy replies scored by the task's reward (`number`: the reply's last number; "
             f"`exact`: the reply; `countdown`: every step true and the target reached)"
             + (f"; {k} sampled replies per question for the chat stages." if k else "."), ""]
    lines += tables(card, nums) + behaviour(card)
    for s, st in card["story"].items():
        if st:
            lines.append(f"- story prompt, {s}: {st['reply']!r:.200}")
    return "\n".join(lines) + "\n"


def figure(path, card: dict) -> None:
    """report.png: greedy held-out accuracy per task (rows) across the stages (bars), with the 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, stages = [r["label"] for r in card["rows"]], card["stages"]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(stages)
    for j, s in enumerate(stages):
        acc = [accuracy(card["scores"][s][lb]["off"]["right"]) for lb in labels]
        ax.bar([i + j * width for i in range(len(labels))], [100 * a[0] for a in acc], width, label=s,
               yerr=[[100 * (a[0] - a[1]) for a in acc], [100 * (a[2] - a[0]) for a in acc]], capsize=1.5)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("held-out accuracy, greedy (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, ncol=4)
    ax.set_title("Report card: held-out accuracy per task by stage, with 95% intervals")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
