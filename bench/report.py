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
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from bench.measure import EVENTS_PER_SECOND, Measurement

__all__ = ["summary_table", "write_chart", "write_json"]

_SUBJECT_COLOR = "#2b6cb0"
_BASELINE_COLOR = "#a0aec0"
_TARGET_COLOR = "#c53030"


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write pretty JSON with sorted keys (stable diffs), replacing the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # *.tmp is git-ignored
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_chart(path: Path, title: str, subtitle: str,
                measurements: Sequence[Measurement]) -> None:
    """A horizontal bar per measurement (median events/s, whiskers min..max), with the
    ratio to its baseline next to the measurements that have one.

    Measurements in groups, or in another unit than events/s, get one panel
    per group instead (see :func:`_write_panels`).
    """
    if any(m.group is not None or m.unit != EVENTS_PER_SECOND for m in measurements):
        _write_panels(path, title, subtitle, measurements)
        return
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
    _save(fig, path)


def _write_panels(path: Path, title: str, subtitle: str,
                  measurements: Sequence[Measurement]) -> None:
    """One panel per group, in order of first appearance: a horizontal bar per
    measurement (median, whiskers min..max) on the group's own axis, the ratio to
    its baseline after the value, and a dashed line at its target if it has one."""
    groups: dict[str, list[Measurement]] = {}
    for m in measurements:
        groups.setdefault(m.group or "", []).append(m)
    heights = [0.9 + 0.42 * len(members) for members in groups.values()]
    fig, axes = plt.subplots(len(groups), 1, figsize=(11, 0.9 + sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    labels = {m.name: m.label for m in measurements}
    for ax, (group, members) in zip(axes[:, 0], groups.items(), strict=True):
        _draw_panel(ax, group, members, labels)
    inches = fig.get_figheight()  # title and subtitle keep their size whatever the panels
    fig.suptitle(title, fontsize=12, x=0.01, y=1 - 0.12 / inches, ha="left", va="top")
    fig.text(0.01, 1 - 0.42 / inches, subtitle, fontsize=8, color="#4a5568", va="top")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / inches))
    _save(fig, path)


def _draw_panel(ax: Any, group: str, members: list[Measurement], labels: dict[str, str]) -> None:
    units = {m.unit for m in members}
    if len(units) != 1:
        raise ValueError(f"chart group {group!r} mixes units: {sorted(units)}")
    unit = units.pop()
    rows = range(len(members))
    medians = [m.median for m in members]
    lows = [m.median - min(m.values) for m in members]
    highs = [max(m.values) - m.median for m in members]
    ax.barh(rows, medians, xerr=[lows, highs], color=_SUBJECT_COLOR, capsize=3, height=0.6,
            error_kw={"elinewidth": 1, "ecolor": "#2d3748"})
    ax.set_yticks(list(rows), [m.label for m in members], fontsize=9)
    ax.invert_yaxis()  # first measurement on top, as in the JSON
    tops = [max(m.values) for m in members]
    targets = [m.target for m in members if m.target is not None]
    smallest = min([v for v in medians if v > 0] + targets, default=1.0)
    largest = max(tops + targets)
    # A linear axis shows proportions (a speed-up reads as bar length); a log
    # axis only where values span orders of magnitude (seconds against ms).
    log = smallest > 0 and largest / smallest > 30
    if log:
        ax.set_xscale("log")
        ax.set_xlim(smallest / 2, largest * 12)
    else:
        ax.set_xlim(0, largest * 1.45)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _short(x)))
    ax.set_xlabel(unit + (" (log scale)" if log else ""), fontsize=9)
    ax.set_title(group, fontsize=10, loc="left")
    for row, m in zip(rows, members, strict=True):
        text = f"{_value(m.median)} {unit}"
        if m.ratio is not None and m.baseline is not None:
            text += f"   {m.ratio:.2f}× vs {labels.get(m.baseline, m.baseline)}"
        ax.text(max(m.values) * (1.1 if log else 1.0) + (0 if log else largest * 0.02), row,
                text, va="center", fontsize=8)
        if m.target is not None:
            ax.plot([m.target, m.target], [row - 0.42, row + 0.42], color=_TARGET_COLOR,
                    linestyle="--", linewidth=1.5)
    if targets:
        ax.legend(handles=[Line2D([], [], color=_TARGET_COLOR, linestyle="--", label="target")],
                  loc="lower right", fontsize=8)
    ax.grid(axis="x", which="major", alpha=0.3)
    ax.set_axisbelow(True)


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def summary_table(measurements: Sequence[Measurement]) -> str:
    """The measurements as a Markdown table (median, all values, ratio), with a unit
    column when they are not all events/s."""
    if any(m.unit != EVENTS_PER_SECOND for m in measurements):
        return _summary_table_units(measurements)
    lines = [
        "| measurement | events/run | median events/s | all runs | ratio |",
        "|---|---:|---:|---|---:|",
    ]
    for m in measurements:
        runs = ", ".join(f"{v:,.0f}" for v in m.values)
        ratio = "" if m.ratio is None else f"{m.ratio:.2f}"
        lines.append(f"| {m.label} | {m.events:,} | {m.median:,.0f} | {runs} | {ratio} |")
    return "\n".join(lines)


def _summary_table_units(measurements: Sequence[Measurement]) -> str:
    lines = [
        "| measurement | median | unit | all runs | ratio |",
        "|---|---:|---|---|---:|",
    ]
    group: str | None = None
    for m in measurements:
        if m.group is not None and m.group != group:
            group = m.group
            lines.append(f"| **{group}** | | | | |")
        runs = ", ".join(_value(v) for v in m.values)
        ratio = "" if m.ratio is None else f"{m.ratio:.2f}"
        lines.append(f"| {m.label} | {_value(m.median)} | {m.unit} | {runs} | {ratio} |")
    return "\n".join(lines)


def _value(value: float) -> str:
    """Three significant digits at most, thousands separated: 12,345 / 123 / 12.3 / 1.23."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _short(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"
