"""The drill's report: ``report.json`` (per-round summaries), ``summary.md`` and ``timeline.png``.

The JSON keeps one small object per round, never per-request data, so a 100-round report stays a few
tens of kilobytes. The timeline is drawn from the request records while they are still in memory.
matplotlib (the ``drill`` extra) is imported only here, and only when the report is written; without it
the report is complete but for the picture, and ``summary.md`` says how to get it.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hotweights.chaos.hostscenarios import SCENARIOS
from hotweights.chaos.load import RequestRecord
from hotweights.chaos.measure import MEASURES, RoundResult
from hotweights.stats import percentile, whole_ms

log = logging.getLogger(__name__)

NO_TIMELINE = "the timeline picture needs matplotlib: `pip install 'hotweights[drill]'`, then run the drill again"


def stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {f"p{q}": round(percentile(values, q), 1) for q in (50, 95, 99)} | {"max": round(max(values), 1)}


def summarize(results: Sequence[RoundResult], judge: bool) -> dict[str, Any]:
    """Per scenario: rounds, the percentiles of each measure and the totals; plus the drill's totals."""
    scenarios: dict[str, Any] = {}
    for name in dict.fromkeys(r.scenario for r in results):
        rounds = [r for r in results if r.scenario == name]
        ran = [r for r in rounds if not r.skipped]
        scenarios[name] = {
            "rounds": len(ran),
            "skipped": rounds[0].skipped if not ran else None,
            "measures": {m: stats([getattr(r, m) for r in ran if getattr(r, m) is not None]) for m in MEASURES},
            "totals": totals(ran, judge),
        }
    ran = [r for r in results if not r.skipped]
    return {"scenarios": scenarios, "totals": totals(ran, judge)}


def totals(ran: Sequence[RoundResult], judge: bool) -> dict[str, int]:
    return {
        "requests": sum(r.requests for r in ran),
        "failed": sum(r.failed for r in ran),
        "refused": sum(r.refused for r in ran),
        "suspects": sum(r.suspects for r in ran),
        "retried": sum(r.retried or 0 for r in ran),
        "wrong": sum(r.wrong for r in ran),
        "split_brain": sum(r.split_brain for r in ran),
        "leaks": sum(bool(r.leak) for r in ran),
        "failed_rounds": sum(bool(r.failures(judge)) for r in ran),
    }


def write_report(
    out: Path,
    args: argparse.Namespace,
    results: Sequence[RoundResult],
    records: Sequence[RequestRecord],
    sweeps: int,
    began: float,
) -> Path:
    """Write ``report.json``, ``timeline.png`` (when matplotlib is importable) and ``summary.md``; return the
    summary's path."""
    out.mkdir(parents=True, exist_ok=True)
    judge = args.lb == "gateway"
    command = "hotweights " + shlex.join(sys.argv[sys.argv.index("drill") :] if "drill" in sys.argv else ["drill"])
    summary = summarize(results, judge)
    meta = {
        "command": command,
        "lb": args.lb,
        "rps": args.rps,
        "rounds": len(results),
        "split_brain_sweeps": sweeps,
        "duration_s": round((results[-1].ended_at - began) if results else 0.0, 1),
        "host": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
    }
    document = meta | {"summary": summary, "rounds": [_compact(r, began) for r in results]}
    (out / "report.json").write_text(dump(document))
    timeline = draw_timeline(out / "timeline.png", results, records, began)
    (out / "summary.md").write_text(render_markdown(meta, summary, results, judge, timeline))
    return out / "summary.md"


def dump(document: dict[str, Any]) -> str:
    """JSON with one line per scenario summary and per round: small, and still readable and diffable."""

    def lines(items: dict[str, Any] | list[Any]) -> str:
        keyed = items.items() if isinstance(items, dict) else ((None, v) for v in items)
        compact = (("" if k is None else f"{json.dumps(k)}: ") + json.dumps(v, separators=(",", ":")) for k, v in keyed)
        return ",\n".join(f"  {row}" for row in compact)

    summary = document["summary"]
    head = "\n".join(
        f" {json.dumps(k)}: {json.dumps(v)}," for k, v in document.items() if k not in ("summary", "rounds")
    )
    return (
        f"{{\n{head}\n"
        f' "totals": {json.dumps(summary["totals"])},\n'
        f' "scenarios": {{\n{lines(summary["scenarios"])}\n }},\n'
        f' "rounds": [\n{lines(document["rounds"])}\n ]\n}}\n'
    )


def _compact(result: RoundResult, began: float) -> dict[str, Any]:
    """One round for the JSON: times as seconds since the drill began, empty fields left out."""
    row = result.to_json()
    for key in ("started_at", "ended_at", "fault_at", "detected_at", "promoted_at", "recovered_at"):
        if row.get(key) is not None:
            row[key] = round(row[key] - began, 3)
    row["later_faults"] = [round(at - began, 3) for at in row["later_faults"]]
    before, after = (
        {k: v for k, v in row.pop(key).items() if v is not None} for key in ("memory_before", "memory_after")
    )
    row |= {"memory": after} if before == after else {"memory_before": before, "memory_after": after}
    return {k: v for k, v in row.items() if v is not None and v is not False and v not in ([], {}, "")}


def _fmt(value: float | None) -> str:
    return "-" if value is None else whole_ms(value)


def render_markdown(
    meta: dict[str, Any], summary: dict[str, Any], results: Sequence[RoundResult], judge: bool, timeline: Path | None
) -> str:
    """The summary; it shows ``timeline`` (a file next to it), or says how to get one when it is None."""
    t = summary["totals"]
    lines = [
        "# Chaos drill report",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Load balancer: {meta['lb']}; load: {meta['rps']:g} requests/s; {meta['rounds']} rounds in "
        f"{meta['duration_s']:g} s; split-brain detector: {meta['split_brain_sweeps']} sweeps of GET /primary "
        f"on every engine. Host: {meta['host']}.",
        "",
        f"**Totals:** {t['requests']} requests, {t['failed']} failed ({t['refused']} refused a connection, "
        f"{t['suspects']} refused as suspect), "
        f"{t['retried']} retried by the gateway, "
        f"{t['wrong']} wrong outputs, {t['split_brain']} split-brain samples, {t['leaks']} leaks, "
        f"{t['failed_rounds']} failed rounds.",
        "",
        "Times in ms, nearest-rank percentiles over the rounds of each scenario: detection = fault to the "
        "controller's first event about the hurt process; fence, promotion and respawn = the controller's recorded "
        "durations; LB convergence = fault to the first success of a request sent after it; outage = last "
        "success before the fault to that first success; quiet outage = the same at an instant 0.5 s before the "
        "fault, when nothing was wrong (the floor the load and the requests' own time set); redundancy = the "
        "round's last fault to full redundancy again (a serving primary, every other slot a ready standby; each "
        "round's is in report.json).",
        "",
        "| scenario | rounds | measure | p50 | p95 | p99 | max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in summary["scenarios"].items():
        if row["skipped"]:
            lines.append(f"| {name} | skipped | {row['skipped']} | | | | |")
            continue
        for i, measure in enumerate(MEASURES):
            s = row["measures"][measure] or {}
            first = f"| {name} | {row['rounds']} " if i == 0 else "| | "
            cells = " | ".join(_fmt(s.get(k)) for k in ("p50", "p95", "p99", "max"))
            lines.append(f"{first}| {measure.removesuffix('_ms')} | {cells} |")
    lines += [
        "",
        "| scenario | what it measures | requests | failed | refused | suspect | retried | wrong | split brain "
        "| leaks |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in summary["scenarios"].items():
        tt = row["totals"]
        note = " (errors expected: the fault is the load balancer)" if SCENARIOS[name].client_errors_expected else ""
        lines.append(
            f"| {name} | {SCENARIOS[name].measures}{note} | {tt['requests']} | {tt['failed']} | {tt['refused']} "
            f"| {tt['suspects']} "
            f"| {tt['retried']} "
            f"| {tt['wrong']} | {tt['split_brain']} | {tt['leaks']} |"
        )
    failed = [(r, r.failures(judge)) for r in results if r.failures(judge)]
    if failed:
        lines += ["", "## Failed rounds", ""]
        lines += [f"- {r.scenario} #{r.index + 1}: {'; '.join(f)}" for r, f in failed]
    lines.append("")
    lines.append(f"![timeline]({timeline.name})" if timeline else NO_TIMELINE)
    lines.append("")
    return "\n".join(lines)


def draw_timeline(
    path: Path, results: Sequence[RoundResult], records: Sequence[RequestRecord], began: float
) -> Path | None:
    """Latency of every request over time (failures in red), each round shaded and labelled with its scenario,
    with fault, detection and promotion markers; ``path``, or None (and a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no timeline.png: %s", NO_TIMELINE)
        return None
    fig, ax = plt.subplots(figsize=(max(12, len(results) * 0.25), 5), dpi=100)
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    ax.scatter([r.start - began for r in ok], [(r.end - r.start) * 1000 for r in ok], s=2, c="tab:blue", label="ok")
    ax.scatter(
        [r.start - began for r in bad], [(r.end - r.start) * 1000 for r in bad], s=10, c="tab:red", marker="x",
        label="failed",
    )  # fmt: skip
    ax.set_yscale("log")
    label_rounds(ax, results, began)
    mark_events(ax, results, began)
    ax.set_xlabel("seconds since the drill began")
    ax.set_ylabel("request latency (ms)")
    ax.set_title(f"{len(results)} rounds, {len(records)} requests, {len(bad)} failed")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def label_rounds(ax: Any, results: Sequence[RoundResult], began: float) -> None:
    """Shade every other round and name each one's scenario at its start, along the top."""
    top = ax.get_xaxis_transform()  # x in data, y in axes fractions
    for i, r in enumerate(results):
        start, end = r.started_at - began, (r.ended_at or r.started_at) - began
        if i % 2:
            ax.axvspan(start, end, color="0.93", zorder=0)
        ax.text(start, 0.99, f" {r.scenario} #{r.index + 1}", transform=top, rotation=90, va="top", fontsize=6)


# Fault, detection and promotion come within milliseconds of each other in a kill round: on a drill's time
# axis their lines coincide, so each kind also gets its own line style and a glyph at its own height.
MARKERS = (
    ("fault_at", "tab:red", "-", "v", 0.06, "fault"),
    ("detected_at", "tab:orange", "--", "D", 0.11, "detected"),
    ("promoted_at", "tab:green", ":", "^", 0.16, "promoted"),
)


def mark_events(ax: Any, results: Sequence[RoundResult], began: float) -> None:
    bottom = ax.get_xaxis_transform()
    for attr, color, style, glyph, height, label in MARKERS:
        times = [getattr(r, attr) - began for r in results if getattr(r, attr)]
        for t in times:
            ax.axvline(t, color=color, ls=style, lw=0.8, alpha=0.8)
        ax.scatter(times, [height] * len(times), transform=bottom, color=color, marker=glyph, s=18, label=label)
