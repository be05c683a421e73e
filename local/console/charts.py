"""Throughput over time as an SVG drawn on the server (no script, no asset fetched)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from html import escape

#: the entry states whose arrivals the chart counts, and their colours
SERIES = {"verified": "#2b7bb9", "consumed": "#2e9d57", "dead": "#c0392b"}
WIDTH, HEIGHT, PAD = 640, 180, 28
BUCKETS = 40


def _when(at: str) -> float | None:
    try:
        return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def ago(at: str) -> str:
    """How long ago the RFC 3339 time ``at`` was, rounded for a person ("" if unknown)."""
    t = _when(at) if at else None
    if t is None:
        return ""
    s = max(datetime.now().timestamp() - t, 0.0)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.0f} h"


def throughput_svg(moves: Iterable[tuple[str, str]]) -> str:
    """Entries reaching each state of ``SERIES`` per time bucket, from the journal's
    (at, to_state) pairs; a short note when there is nothing to draw."""
    points = [(t, state) for at, state in moves
              if state in SERIES and (t := _when(at)) is not None]
    if not points:
        return '<p class="muted">No entry has been verified, consumed or dead yet.</p>'
    start = min(t for t, _ in points)
    span = max(max(t for t, _ in points) - start, 1.0)
    step = span / BUCKETS
    counts = Counter((state, min(int((t - start) / step), BUCKETS - 1)) for t, state in points)
    top = max(counts.values())

    def x(i: int) -> float:
        return PAD + (WIDTH - 2 * PAD) * i / (BUCKETS - 1)

    def y(n: int) -> float:
        return HEIGHT - PAD - (HEIGHT - 2 * PAD) * n / top

    lines = []
    for state, colour in SERIES.items():
        path = " ".join(f"{x(i):.1f},{y(counts[(state, i)]):.1f}" for i in range(BUCKETS))
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" '
                     f'points="{path}"><title>{state}</title></polyline>')
    legend = "".join(f'<text x="{PAD + 110 * k}" y="14" fill="{c}">{escape(s)}</text>'
                     for k, (s, c) in enumerate(SERIES.items()))
    return (f'<svg class="chart" role="img" aria-label="throughput" viewBox="0 0 {WIDTH} '
            f'{HEIGHT}" width="{WIDTH}" height="{HEIGHT}">{legend}'
            f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" '
            f'stroke="#999"/><text x="{PAD}" y="{HEIGHT - 8}">0 s</text>'
            f'<text x="{WIDTH - PAD - 60}" y="{HEIGHT - 8}">{span:.0f} s</text>'
            f'<text x="2" y="{PAD}">{top}</text>{"".join(lines)}</svg>')
