"""Small inline SVG charts for the admin, rendered on the server (no script, no CDN)."""

from __future__ import annotations

from collections.abc import Sequence

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

WIDTH, HEIGHT = 440, 150
MARGIN_LEFT, MARGIN_BOTTOM, MARGIN_TOP, MARGIN_RIGHT = 44, 22, 10, 8


def _hours(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def lines_chart(
    t: Sequence[float],
    series: Sequence[tuple[str, str, Sequence[float]]],
    *,
    title: str,
) -> SafeString:
    """A line per (label, colour, values) over the times `t` (seconds), one shared y axis
    from 0 to the largest value, a legend, and the axes' ends labelled."""
    points = len(t)
    top = max((v for _, _, values in series for v in values), default=0) or 1
    span = (t[-1] - t[0]) if points > 1 else 1.0
    plot_w, plot_h = WIDTH - MARGIN_LEFT - MARGIN_RIGHT, HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def xy(ti: float, v: float) -> str:
        x = MARGIN_LEFT + (ti - t[0]) / span * plot_w
        y = MARGIN_TOP + plot_h - v / top * plot_h
        return f"{x:.1f},{y:.1f}"

    polylines = format_html_join(
        "",
        '<polyline fill="none" stroke="{}" stroke-width="1.6" points="{}"><title>{}</title></polyline>',
        (
            (colour, " ".join(xy(ti, v) for ti, v in zip(t, values, strict=True)), label)
            for label, colour, values in series
            if points
        ),
    )
    legend = format_html_join(
        "",
        '<tspan fill="{}" dx="10">&#9644; {}</tspan>',
        ((colour, label) for label, colour, _ in series),
    )
    bottom = MARGIN_TOP + plot_h
    return format_html(
        '<svg class="fq-chart" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'role="img" aria-label="{title}">'
        '<text x="{left}" y="9" font-size="10">{title}{legend}</text>'
        '<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#999"/>'
        '<line x1="{left}" y1="{top_y}" x2="{left}" y2="{bottom}" stroke="#999"/>'
        '<text x="{ylab}" y="{top_label}" font-size="10" text-anchor="end">{top}</text>'
        '<text x="{ylab}" y="{bottom}" font-size="10" text-anchor="end">0</text>'
        '<text x="{left}" y="{xlab}" font-size="10">0</text>'
        '<text x="{right}" y="{xlab}" font-size="10" text-anchor="end">{span}</text>'
        "{lines}</svg>",
        w=WIDTH,
        h=HEIGHT,
        title=title,
        legend=legend,
        left=MARGIN_LEFT,
        right=WIDTH - MARGIN_RIGHT,
        top_y=MARGIN_TOP,
        bottom=bottom,
        ylab=MARGIN_LEFT - 4,
        top_label=MARGIN_TOP + 8,
        top=f"{top:,.0f}",
        xlab=HEIGHT - 6,
        span=_hours(span),
        lines=polylines,
    )
