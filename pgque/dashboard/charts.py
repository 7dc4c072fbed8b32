"""Charts as SVG drawn on the server: a page needs no script to show them, and
a value never reaches markup but as a number."""

from __future__ import annotations

import time
from collections.abc import Sequence

from markupsafe import Markup, escape


def sparkline(points: Sequence[tuple[float, float]], *, width: int = 240, height: int = 40,
              span: float = 3600.0, label: str = "", unit: str = "/s") -> Markup:
    """A line of (time, value) points over the last ``span`` seconds (or the time
    there are points for, if shorter: a dashboard started a minute ago draws
    that minute across), scaled to its largest value, with that value written
    in the corner; an empty frame when there are fewer than two points."""
    now = time.time()
    if points:
        span = min(span, max(60.0, now - points[0][0]))
    shown = [(t, v) for t, v in points if t >= now - span]
    top = max((v for _, v in shown), default=0.0)
    frame = (f'<svg class="spark" role="img" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}"><title>{escape(label)}</title>'
             f'<rect x="0" y="0" width="{width}" height="{height}" class="spark-frame"/>')
    if len(shown) < 2:
        return Markup(frame + "</svg>")
    scale = (height - 4) / top if top > 0 else 0.0
    path = " ".join(
        f"{'M' if i == 0 else 'L'}{(t - (now - span)) / span * width:.1f},"
        f"{height - 2 - v * scale:.1f}" for i, (t, v) in enumerate(shown))
    return Markup(frame + f'<path d="{path}" class="spark-line"/>'
                  f'<text x="{width - 4}" y="12" text-anchor="end" class="spark-top">'
                  f"{top:,.1f}{escape(unit)}</text></svg>")

