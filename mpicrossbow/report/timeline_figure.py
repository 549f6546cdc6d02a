"""A picture of ``timeline.json``: one row per rank and track, a bar per span, a tick per message.

Chrome's tracing view and Perfetto show the file interactively; this is the static picture
``crossbow-report`` saves as ``timeline.png`` beside it, so a run on a cluster can be looked at without a
browser. Colours follow the span's category (compute, exchange, bucket, data, validation, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Category → colour (others: grey).
COLOURS = {
    "compute": "tab:blue",
    "exchange": "tab:red",
    "bucket": "tab:orange",
    "data": "tab:green",
    "validation": "tab:purple",
    "checkpoint": "tab:brown",
    "message": "tab:pink",
    "gossip": "tab:olive",
}


def timeline_figure(events: Sequence[dict[str, Any]]) -> Figure:
    """Spans (``ph`` X) as bars and instants (``ph`` i) as ticks, in milliseconds, per (rank, track)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"}
    shown = sorted({(e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "i")})
    rows = {key: i for i, key in enumerate(shown)}
    figure = Figure(figsize=(15, 1.2 + 0.45 * max(len(rows), 1)), layout="constrained")
    ax = figure.subplots()
    for event in events:
        if event["ph"] not in ("X", "i"):
            continue
        row, colour = rows[(event["pid"], event["tid"])], COLOURS.get(event.get("cat", ""), "grey")
        if event["ph"] == "X":
            ax.broken_barh([(event["ts"] / 1e3, event["dur"] / 1e3)], (row - 0.4, 0.8), color=colour)
        else:
            ax.plot([event["ts"] / 1e3], [row], "|", color=colour, markersize=12)
    ax.set_yticks(range(len(rows)), [f"{names.get((p, None), p)} {names.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the ranks' common start")
    used = sorted({e.get("cat", "") for e in events if e["ph"] in ("X", "i")})
    ax.legend(
        handles=[Patch(color=COLOURS.get(c, "grey"), label=c) for c in used],
        loc="upper right",
        fontsize="small",
    )
    ax.set_title("timeline")
    return figure
