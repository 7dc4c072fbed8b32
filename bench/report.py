"""A suite's output: ``<suite>.json``, ``<suite>.png`` and a text table for the terminal."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

# Files only, no display (servers, CI); chosen before pyplot is imported.
matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from bench.measure import Measurement

__all__ = ["summary_table", "write_chart", "write_json"]

_SUBJECT_COLOR = "#2b6cb0"
_BASELINE_COLOR = "#a0aec0"


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write pretty JSON with sorted keys (stable diffs), replacing the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # *.tmp is git-ignored
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_chart(path: Path, title: str, subtitle: str,
                measurements: Sequence[Measurement]) -> None:
    """A horizontal bar per measurement (median events/s, whiskers min..max), with the
    ratio to its baseline next to the measurements that have one."""
    baselines = {m.baseline for m in measurements if m.baseline is not None}
    medians = [m.median for m in measurements]
    lows = [m.median - min(m.values) for m in measurements]
    highs = [max(m.values) - m.median for m in measurements]
    colors = [_BASELINE_COLOR if m.name in baselines else _SUBJECT_COLOR for m in measurements]

    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.55 * len(measurements)))
    rows = range(len(measurements))
    ax.barh(rows, medians, xerr=[lows, highs], color=colors, capsize=3,
            error_kw={"elinewidth": 1, "ecolor": "#2d3748"})
    ax.set_yticks(list(rows), [m.label for m in measurements])
    ax.invert_yaxis()  # first measurement on top, as in the JSON
    # Rates span three orders of magnitude (one commit per event vs. batches).
    ax.set_xscale("log")
    ax.set_xlim(min(medians) / 3, max(max(m.values) for m in measurements) * 8)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _short(x)))
    ax.set_xlabel("events/s (log scale)")
    for row, m in zip(rows, measurements, strict=True):
        text = f"{m.median:,.0f}/s"
        if m.ratio is not None:
            text += f"   {m.ratio:.2f}× baseline"
        ax.text(max(m.values) * 1.15, row, text, va="center", fontsize=9)
    if baselines:
        ax.legend(handles=[Patch(color=_SUBJECT_COLOR, label="pgque"),
                           Patch(color=_BASELINE_COLOR, label="baseline: plain SQL")],
                  loc="lower right", fontsize=8)
    ax.grid(axis="x", which="major", alpha=0.3)
    ax.set_axisbelow(True)
    fig.suptitle(title, fontsize=12, x=0.01, ha="left")
    ax.set_title(subtitle, fontsize=8, loc="left", color="#4a5568")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def summary_table(measurements: Sequence[Measurement]) -> str:
    """The measurements as a Markdown table (median, all values, ratio)."""
    lines = [
        "| measurement | events/run | median events/s | all runs | ratio |",
        "|---|---:|---:|---|---:|",
    ]
    for m in measurements:
        runs = ", ".join(f"{v:,.0f}" for v in m.values)
        ratio = "" if m.ratio is None else f"{m.ratio:.2f}"
        lines.append(f"| {m.label} | {m.events:,} | {m.median:,.0f} | {runs} | {ratio} |")
    return "\n".join(lines)


def _short(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"
