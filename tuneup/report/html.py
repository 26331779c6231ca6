"""The report as one self-contained HTML page: the findings, what was measured, and plots
drawn as inline SVG by the small helpers below. Nothing is loaded from anywhere (no script,
font, stylesheet or image), so the file works offline and from file://.

Every string from the document (rule text, paths, source lines) is data and is escaped.
Missing or non-finite values (None, float nan/inf, or the strings "nan"/"inf" a JSON round
trip leaves) are left out of the plots and shown as "–" in text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from ..format import percent, plural, read_rate, seconds
from . import summary
from .text import checked_summary, ranks_label

Point = tuple[float, float]
Line = tuple[str, str, list[Point]]  # legend label, colour, data points

WIDTH, HEIGHT = 760, 250
LEFT, RIGHT, TOP, BOTTOM = 64, 52, 34, 40  # the plot area's margins inside the viewBox
# Okabe-Ito colours: told apart with colour-blindness; areas are opaque (exact pixel colours).
PARTS = (("data_wait", "data wait", "#d55e00"), ("input", "input (your loop)", "#f0e442"),
         ("forward", "forward", "#0072b2"),
         ("backward", "backward", "#56b4e9"), ("optimizer", "optimizer", "#009e73"),
         ("other", "other (your loop)", "#a0a0a0"))
STALL, SCALE, SKIPS, LOSS = "#d55e00", "#cc79a7", "#e69f00", "#404040"
RATES = ("#0072b2", "#009e73", "#d55e00", "#cc79a7")  # one per optimizer
GPU_UTILIZATION, GPU_MEMORY = "#0072b2", "#009e73"

CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1f2328;background:#fff;
 max-width:980px;margin:24px auto;padding:0 20px}
h1{font-size:1.5em;margin:0 0 4px}h2{margin:28px 0 8px;border-bottom:1px solid #d0d7de}
h3{font-size:1.05em;margin:0 0 6px}.meta,.rule,.ranks,.dim{color:#656d76}
.finding{border:1px solid #d0d7de;border-left:5px solid var(--sev);border-radius:6px;padding:8px 14px;
 margin:10px 0;break-inside:avoid}.high{--sev:#c62828}.medium{--sev:#b26a00}.low{--sev:#0e7490}
.badge{background:var(--sev);color:#fff;border-radius:4px;padding:1px 6px;font-size:.75em;margin-right:4px}
.finding dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:6px 0}
.finding dt{color:#656d76}.finding dd{margin:0}.apply{color:#1a7f37}.ok{color:#1a7f37;font-weight:600}
pre{background:#f6f8fa;border-radius:6px;padding:6px 10px;margin:2px 0;overflow-x:auto;white-space:pre-wrap}
code,pre{font:13px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
table{border-collapse:collapse;margin:6px 0 12px}td,th{padding:3px 14px 3px 0;text-align:right}
td:first-child,th:first-child{text-align:left}th{border-bottom:1px solid #d0d7de}.alert{color:#c62828;font-weight:600}
.swatch{display:inline-block;width:10px;height:10px;margin-right:6px}
.numbers{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0;padding:0}
.numbers div{border:1px solid #d0d7de;border-radius:6px;padding:6px 12px;min-width:110px}
.numbers dt{color:#656d76;font-size:.8em}.numbers dd{margin:0;font-size:1.3em;font-weight:600}
figure{margin:16px 0;break-inside:avoid}figcaption{color:#656d76;font-size:.9em}svg{width:100%;height:auto}
svg text{font:11px system-ui,sans-serif;fill:#444}svg .heading{font-weight:600;font-size:12px;fill:#1f2328}
.grid{stroke:#e4e7eb}.axis{stroke:#8c959f}.note{border:1px dashed #d0d7de;border-radius:6px;padding:8px 12px}
@media print{body{max-width:none;margin:0}a{color:inherit}}
"""


def _finite(value: Any) -> float | None:
    """`value` as a finite float; None for None, nan, inf, "nan", "inf" and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _points(xs: Sequence[Any], ys: Sequence[Any], scale: float = 1.0, *, positive: bool = False) -> list[Point]:
    """The (x, y * scale) pairs where both are finite (and y > 0 when `positive`)."""
    pairs = ((_finite(x), _finite(y)) for x, y in zip(xs, ys))
    return [(x, y * scale) for x, y in pairs if x is not None and y is not None and (y > 0 or not positive)]


@dataclass(frozen=True)
class Frame:
    """Maps data coordinates into the viewBox's plot area; y on a log2 scale when `log`."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float
    log: bool = False

    def x(self, value: float) -> float:
        return LEFT + (value - self.x_lo) / (self.x_hi - self.x_lo) * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        lo, hi, v = ((math.log2(self.y_lo), math.log2(self.y_hi), math.log2(value)) if self.log
                     else (self.y_lo, self.y_hi, value))
        return HEIGHT - BOTTOM - (v - lo) / (hi - lo) * (HEIGHT - TOP - BOTTOM)

    def xy(self, points: Sequence[Point]) -> str:
        return " ".join(f"{self.x(x):.1f},{self.y(y):.1f}" for x, y in points)


def _span(lo: float, hi: float) -> tuple[float, float]:
    """A non-empty range around [lo, hi]."""
    return (lo, hi) if hi > lo else (min(lo, hi) - 1, max(lo, hi) + 1)


def _ticks(lo: float, hi: float, count: int = 5, *, outward: bool = False) -> list[float]:
    """Round ticks (1, 2 or 5 times a power of ten) inside [lo, hi], or covering it when `outward`."""
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) if outward else math.ceil(lo / step - 1e-9)
    last = math.ceil(hi / step) if outward else math.floor(hi / step + 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def _log2_ticks(lo: float, hi: float) -> list[float]:
    """At most seven powers of two from lo to hi (both powers of two)."""
    exponents = range(round(math.log2(lo)), round(math.log2(hi)) + 1)
    stride = math.ceil(len(exponents) / 7)
    return [2.0 ** e for e in exponents[::stride]]


def _label(value: float) -> str:
    """A tick label: thousands separated, otherwise the shortest exact form."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:g}"


def _x_axis(frame: Frame, ticks: Sequence[float], label: str) -> str:
    """The bottom axis line, tick labels and axis label."""
    base = HEIGHT - BOTTOM
    out = [f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{base}" y2="{base}"/>']
    for tick in ticks:
        out.append(f'<text x="{frame.x(tick):.1f}" y="{base + 15}" text-anchor="middle">{_label(tick)}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle">{label}</text>')
    return "".join(out)


def _y_axis(frame: Frame, ticks: Sequence[float], label: str, *, right: bool = False) -> str:
    """A vertical axis with tick labels (and grid lines when on the left) and a rotated label."""
    edge = WIDTH - RIGHT if right else LEFT
    anchor, gap = ("start", 6) if right else ("end", -6)
    out = [f'<line class="axis" x1="{edge}" x2="{edge}" y1="{TOP}" y2="{HEIGHT - BOTTOM}"/>']
    for tick in ticks:
        y = frame.y(tick)
        if not right:
            out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text x="{edge + gap}" y="{y + 4:.1f}" text-anchor="{anchor}">{_label(tick)}</text>')
    x = WIDTH - 10 if right else 14
    middle = (TOP + HEIGHT - BOTTOM) / 2
    out.append(f'<text x="{x}" y="{middle}" text-anchor="middle" transform="rotate(-90 {x} {middle})">{label}</text>')
    return "".join(out)


def _legend(entries: Sequence[tuple[str, str]]) -> str:
    """A row of colour swatches and labels above the plot area."""
    out, x = [], float(LEFT)
    for label, colour in entries:
        out.append(f'<rect x="{x}" y="{TOP - 22}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{x + 14}" y="{TOP - 13}">{escape(label)}</text>')
        x += 30 + 6.2 * len(label)
    return "".join(out)


def _polyline(frame: Frame, label: str, colour: str, points: Sequence[Point]) -> str:
    """A line through the points, with a dot on each when there are few."""
    marks = "".join(f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="2.5" fill="{colour}"/>'
                    for x, y in points) if len(points) <= 40 else ""
    return (f'<polyline class="series" data-series="{escape(label)}" fill="none" stroke="{colour}" '
            f'stroke-width="2" stroke-linejoin="round" points="{frame.xy(points)}"/>{marks}')


def _figure(name: str, suffix: str, title: str, caption: str, body: str) -> str:
    """A plot: an <svg> with a <title>, and a caption the svg is described by."""
    ident = name + suffix
    return (f'<figure class="plot {name}" id="{ident}"><svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
            f'aria-labelledby="{ident}-title" aria-describedby="{ident}-caption">'
            f'<title id="{ident}-title">{title}</title>{body}</svg>'
            f'<figcaption id="{ident}-caption"><strong>{title}.</strong> {caption}</figcaption></figure>')


def _note(name: str, suffix: str, title: str, text: str) -> str:
    """What stands in a plot's place (with its id) when there is nothing to draw."""
    return f'<p class="plot note {name}" id="{name}{suffix}"><strong>{title}:</strong> {text}</p>'


def _line_plot(name: str, suffix: str, title: str, caption: str, lines: Sequence[Line], x_label: str,
               y_label: str, *, y_range: tuple[float, float] | None = None) -> str:
    """A plot of one or more lines sharing linear axes; y from 0 unless `y_range` is given."""
    every = [point for _, _, points in lines for point in points]
    x_lo, x_hi = _span(min(0.0, *(x for x, _ in every)), max(x for x, _ in every))
    y_ticks = _ticks(*(y_range or _span(0.0, max(y for _, y in every))), outward=True)
    frame = Frame(x_lo, x_hi, y_ticks[0], y_ticks[-1])
    body = (_y_axis(frame, y_ticks, y_label) + _x_axis(frame, _ticks(x_lo, x_hi), x_label)
            + "".join(_polyline(frame, label, colour, points) for label, colour, points in lines if points)
            + _legend([(label, colour) for label, colour, _ in lines]))
    return _figure(name, suffix, title, caption, body)


def _intervals(series: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(index, first x, last x) of each interval with a known last step: it spans from the
    previous interval's last step (0 for the first) to its own."""
    out, previous = [], 0.0
    for index, step in enumerate(series.get("step", [])):
        if (step := _finite(step)) is not None:
            out.append((index, previous, step))
            previous = step
    return out


def _column(series: dict[str, Any], key: str, index: int) -> float | None:
    """series[key][index] when present and finite."""
    values = series.get(key) or []
    return _finite(values[index]) if index < len(values) else None


def _breakdown_plot(series: dict[str, Any], suffix: str) -> str:
    """Stacked, step-shaped areas: each interval's mean ms per step of each part."""
    name, title = "plot-step-breakdown", "Where a step's time goes, over the run"
    spans = _intervals(series)
    layers = [(key, label, colour) for key, label, colour in PARTS
              if any(_column(series, key, i) is not None for i, _, _ in spans)]
    spans = [span for span in spans if any(_column(series, key, span[0]) is not None for key, _, _ in layers)]
    if not spans:
        return _note(name, suffix, title, "no step was measured")
    heights = [[1e3 * (_column(series, key, i) or 0.0) for key, _, _ in layers] for i, _, _ in spans]
    y_ticks = _ticks(*_span(0.0, max(sum(row) for row in heights)), outward=True)
    frame = Frame(0.0, spans[-1][2], 0.0, y_ticks[-1])
    areas, base = [], [0.0] * len(spans)
    for k, (key, _, colour) in enumerate(layers):
        top = [low + row[k] for low, row in zip(base, heights)]
        upper = [(x, high) for (_, a, b), high in zip(spans, top) for x in (a, b)]
        lower = [(x, low) for (_, a, b), low in zip(spans, base) for x in (a, b)][::-1]
        areas.append(f'<polygon class="series area" data-series="{key}" fill="{colour}" '
                     f'points="{frame.xy(upper + lower)}"/>')
        base = top
    missing = [part[1] for part in PARTS if part not in layers]
    caption = ("Mean milliseconds per step of each part, per measurement interval, stacked: the top edge is the "
               "mean step time. 'Other' is the rest of the step: your loop's own code"
               + (f" (and {', '.join(missing)}: not measured on this run)." if missing else "."))
    body = (_y_axis(frame, y_ticks, "ms per step") + _x_axis(frame, _ticks(0.0, spans[-1][2]), "step")
            + "".join(areas) + _legend([(label, colour) for _, label, colour in layers]))
    return _figure(name, suffix, title, caption, body)


def _skip_bars(frame: Frame, spans: Sequence[tuple[int, float, float]], series: dict[str, Any]) -> str:
    """A bar per interval with skipped steps, ending at the interval's last step."""
    out = []
    for index, first, last in spans:
        skipped = _column(series, "skipped_steps", index) or 0.0
        if skipped > 0:
            width = max(3.0, 0.5 * (frame.x(last) - frame.x(first)))
            out.append(f'<rect class="skips" x="{frame.x(last) - width:.1f}" y="{frame.y(skipped):.1f}" '
                       f'width="{width:.1f}" height="{frame.y(0.0) - frame.y(skipped):.1f}" fill="{SKIPS}"/>')
    return "".join(out)


def _scaler_plot(series: dict[str, Any], scaler: dict[str, Any], suffix: str) -> str:
    """The loss scale on a log2 axis, over bars of the steps skipped in each interval."""
    name, title = "plot-scaler", "GradScaler loss scale and skipped steps"
    scales = _points(series.get("step", []), series.get("scale", []), positive=True)
    if not (scaler.get("present") and scaler.get("enabled") and scales):
        return _note(name, suffix, title, escape(summary.scaler_line(scaler)) + ": no loss-scale plot")
    spans = _intervals(series)
    last_step = spans[-1][2]
    y_lo = 2.0 ** (math.ceil(math.log2(min(y for _, y in scales))) - 1)  # a power of two below the lowest
    y_hi = 2.0 ** (math.floor(math.log2(max(y for _, y in scales))) + 1)  # and one above the highest
    frame = Frame(0.0, last_step, y_lo, y_hi, log=True)
    most = max((_column(series, "skipped_steps", i) or 0.0 for i, _, _ in spans), default=0.0)
    skip_ticks = _ticks(0.0, max(most, 2.0), count=3, outward=True)  # 2 or more: whole-number ticks
    skip_frame = Frame(0.0, last_step, 0.0, skip_ticks[-1])
    body = (_y_axis(frame, _log2_ticks(y_lo, y_hi), "loss scale (log₂)")
            + _y_axis(skip_frame, skip_ticks, "skipped", right=True) + _x_axis(frame, _ticks(0.0, last_step), "step")
            + _skip_bars(skip_frame, spans, series) + _polyline(frame, "loss scale", SCALE, scales)
            + _legend([("loss scale (left axis)", SCALE), ("skipped steps per interval (right axis)", SKIPS)]))
    caption = ("The scale halves at each overflow (a skipped optimizer step) and grows after a run of good "
               "steps; a scale stuck low or many skips mean values overflow in fp16.")
    return _figure(name, suffix, title, caption, body)


def _gpu_plot(series: dict[str, Any], started: float | None, suffix: str) -> str:
    """GPU utilization and memory use (%) against seconds since the run started."""
    name, title = "plot-gpu", "GPU utilization and memory"
    times = [_finite(t) for t in series.get("gpu_time", [])]
    known = [t for t in times if t is not None]
    if not known:
        return _note(name, suffix, title, "no GPU measured on this run")
    start = started if started is not None and started <= min(known) else min(known)
    elapsed = [None if t is None else t - start for t in times]
    lines = [("utilization %", GPU_UTILIZATION, _points(elapsed, series.get("gpu_utilization", []), 100)),
             ("memory used %", GPU_MEMORY, _points(elapsed, series.get("gpu_memory_ratio", []), 100))]
    if not any(points for _, _, points in lines):
        return _note(name, suffix, title, "no GPU utilization or memory value was read")
    caption = "Mean over the job's GPUs of each sample: how busy the GPU was, and how much of its memory was used."
    return _line_plot(name, suffix, title, caption, lines, "seconds since the run started", "%", y_range=(0.0, 100.0))


def _plots(run: dict[str, Any], suffix: str) -> str:
    """A run's plots, each with an id of its name + `suffix`; a note where there is nothing to draw."""
    series, snapshot = run.get("series") or {}, run["snapshot"]
    steps = series.get("step", [])
    stall = _points(steps, series.get("stall_ratio", []), 100)
    loss = _points(steps, series.get("loss", []))
    out = [_breakdown_plot(series, suffix)]
    out.append(_line_plot("plot-stall", suffix, "Data stall over the run",
                          "Share of each interval's time the loop spent waiting for its next batch.",
                          [("data wait % of step time", STALL, stall)], "step", "% of step time")
               if stall else _note("plot-stall", suffix, "Data stall over the run", "no step was measured"))
    out.append(_scaler_plot(series, snapshot.get("scaler") or {}, suffix))
    out.append(_gpu_plot(series, _finite((snapshot.get("run") or {}).get("started_at")), suffix))
    if loss:
        low, high = _span(min(y for _, y in loss), max(y for _, y in loss))
        out.append(_line_plot("plot-loss", suffix, "Loss over the run", "Median finite loss of each interval.",
                              [("loss", LOSS, loss)], "step", "loss", y_range=(low, high)))
    out.append(_rate_plot(series, suffix))
    return "".join(out)


def _rate_plot(series: dict[str, Any], suffix: str) -> str:
    """Each optimizer's learning rate as the job ran it (read on detail steps; the run log's
    end event holds the curve), held between the steps where it changed."""
    name, title = "plot-learning-rate", "Learning rate over the run"
    curves = series.get("learning_rates") or []
    if not curves:
        return _note(name, suffix, title, "the curve is written when the run ends (none in this log yet)")
    last = max(step for curve in curves for step, _ in curve["curve"])
    lines = []
    for index, curve in enumerate(curves):
        points = curve["curve"]
        held = [(points[i + 1][0] if i + 1 < len(points) else last, lr) for i, (_, lr) in enumerate(points)]
        steps = [point for pair in zip(points, held) for point in pair]  # a step shape: held until changed
        lines.append((f"{curve['optimizer']} lr" + (f" #{index + 1}" if len(curves) > 1 else ""),
                      RATES[index % len(RATES)], steps))
    peak = max(lr for _, _, points in lines for _, lr in points)
    return _line_plot(name, suffix, title, "Each optimizer's learning rate (its first param group), read after "
                      "the update of each detail step; a schedule whoever sets it.", lines, "step", "learning rate",
                      y_range=_span(0.0, peak))


def _finding(number: int, finding: dict[str, Any]) -> str:
    """One finding; only an http(s) doc address becomes a link."""
    severity = escape(str(finding["severity"]))
    doc = str(finding["doc"])
    link = f'<a href="{escape(doc)}">{escape(doc)}</a>' if doc.startswith(("https://", "http://")) else escape(doc)
    applied = summary.apply_line(finding)
    apply = f'<div class="apply">{escape(applied, quote=False)}</div>' if applied else ""  # (element text: quotes as they are)
    return (f'<article class="finding {severity}"><h3><span class="badge">{severity.upper()}</span> {number}. '
            f'{escape(finding["title"])} <span class="rule">[{escape(finding["rule"])}]{escape(ranks_label(finding))}</span></h3>'
            f'<dl><dt>measured</dt><dd>{escape(finding["observed"])}</dd>'
            f'<dt>threshold</dt><dd>{escape(finding["threshold"])}</dd>'
            f'<dt>estimated gain</dt><dd>{escape(finding["gain_text"])}</dd>'
            f'<dt>fix</dt><dd><pre><code class="language-python">{escape(finding["fix"])}</code></pre>{apply}</dd>'
            f'<dt>docs</dt><dd>{link}</dd></dl></article>')


def _findings(document: dict[str, Any]) -> str:
    """The ranked findings, or the "No findings" line."""
    findings = document["findings"]
    if not findings:
        return f'<h2>Advice</h2><p class="ok">No findings: {escape(checked_summary(document))}.</p>'
    head = (f"<h2>Advice, ranked by estimated gain</h2><p class=\"dim\">{plural(len(findings), 'finding')}; "
            f"{escape(checked_summary(document))}</p>")
    return head + "".join(_finding(number, finding) for number, finding in enumerate(findings, 1))


def _table(window: dict[str, Any]) -> str:
    """The text report's step-time breakdown table, with each part's plot colour."""
    step = window["step_seconds"]
    rows = [f"<tr><td>step</td><td>{seconds(_finite(step['median']))}</td><td>p90 {seconds(_finite(step['p90']))}</td></tr>"]
    colours = {key: colour for key, _, colour in PARTS}
    for key, label, middle, share in summary.step_parts(window):
        share = _finite(share)
        alert = ' class="alert"' if key == "data_wait" and share and share >= 0.1 else ""
        rows.append(f'<tr{alert}><td><span class="swatch" style="background:{colours[key]}"></span>{label}</td>'
                    f"<td>{seconds(_finite(middle))}</td><td>{percent(share)}</td></tr>")
    return (f"<h3>Where a step's time goes (last {window['steps']} steps; the split from the "
            f"{window['detailed_steps']} detail steps among them)</h3><table><tr><th>part</th><th>median</th>"
            f"<th>share of step time</th></tr>{''.join(rows)}</table>")


def _numbers(totals: dict[str, Any], window: dict[str, Any], syncs: dict[str, Any]) -> str:
    """The headline numbers, as a row of cards."""
    rate, samples = _finite(window.get("steps_per_second")), _finite(window.get("samples_per_second"))
    per_step = _finite(syncs.get("per_step")) if syncs.get("measured") else None
    cells = [("steps", f"{totals['steps']:,}"), ("steps/s", "–" if rate is None else f"{rate:,.1f}"),
             ("samples/s", "–" if samples is None else f"{samples:,.0f}"),
             ("data stall", percent(_finite(window.get("stall_ratio")))),
             ("syncs/step", "–" if per_step is None else f"{per_step:.1f}")]
    return '<dl class="numbers">' + "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in cells) + "</dl>"


def _lines(snapshot: dict[str, Any], window: dict[str, Any]) -> str:
    """The text summary's lines: syncs and their source lines, GradScaler, loss, system, config."""
    syncs = snapshot["syncs"]
    sources = "".join(f"<li>{escape(read_rate(s))} {escape(s['kind'])} at <code>{escape(s['location'])}"
                      f"</code> in {escape(s['function'])}()</li>" for s in syncs.get("top_sources", [])[:6])
    items = [escape(summary.sync_lines(syncs)[0]) + (f"<ul>{sources}</ul>" if sources else ""),
             escape(summary.scaler_line(snapshot["scaler"]))]
    evaluation = summary.evaluation_line((snapshot.get("totals") or {}).get("evaluation"))
    if evaluation:
        items.insert(0, escape(evaluation))
    items[:0] = [escape(line.strip()) for line in summary.compile_lines(snapshot.get("compile"), snapshot.get("totals"))]
    items[:0] = [escape(line.strip()) for line in summary.work_lines(snapshot)]
    loss = window.get("loss")
    if loss:
        last, trend = _finite(loss["last"]), _finite(loss.get("trend"))
        items.append(escape(f"Loss: last {'non-finite' if last is None else f'{last:.4g}'}, {loss['nonfinite_steps']} "
                            f"non-finite of the last {loss['read_steps']}"
                            + (f", trend {trend:+.0%} over the window" if trend is not None else "")))
    items += [escape(line) for line in summary.system_lines(snapshot.get("system"))
              + summary.config_lines(snapshot.get("config"))]
    items += [escape(f"Warning: {warning['message']}") for warning in snapshot.get("warnings", [])]
    items.append(f"Run log: <code>{escape(str(snapshot.get('run_log') or 'not written (see warnings)'))}</code>")
    return "<ul>" + "".join(f"<li>{item}</li>" for item in items) + "</ul>"


def _changes(actions: list[dict[str, Any]]) -> str:
    """Apply mode's changes: the text report's table."""
    if not actions:
        return ""
    head = "".join(f"<th>{escape(column)}</th>" for column in summary.CHANGE_COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>"
                   for row in summary.change_rows(actions))
    net = summary.net_change(actions)
    return (f"<h3>Changes tuneup made (apply mode)</h3><table><tr>{head}</tr>{rows}</table>"
            + (f'<p class="ok">{escape(net)}</p>' if net else ""))


def _run(run: dict[str, Any], index: int, multi: bool) -> str:
    """One run's (rank's) section: what was measured, and its plots."""
    snapshot, rank = run["snapshot"], run["rank"]
    suffix = f"-rank-{rank if rank is not None else index}" if multi else ""
    head = "<h2>What was measured" + (f" (rank {escape(str(rank))})" if rank is not None else "") + "</h2>"
    if not snapshot.get("enabled"):
        return head + f"<p>tuneup was not measuring: {escape(str(snapshot.get('reason')))}</p>"
    totals, window = snapshot["totals"], snapshot["window"]
    intro = (f"<p>tuneup measured {totals['steps']} steps in {seconds(_finite(totals['seconds']))} "
             f"(run <code>{escape(str(snapshot['run'].get('run_id')))}</code>), {escape(snapshot['state'])}.</p>")
    if window is None:
        return head + intro + "<p>No training step was seen: is there an optimizer.step() (or tuneup.step()) in the loop?</p>"
    return (head + intro + _numbers(totals, window, snapshot["syncs"]) + _changes(snapshot.get("actions") or [])
            + _table(window) + _plots(run, suffix)
            + "<h3>Details</h3>" + _lines(snapshot, window))


def to_html(document: dict[str, Any]) -> str:
    """The report document as one self-contained HTML page with inline SVG plots."""
    source = escape(str(document["source"]))
    generated = _finite(document.get("generated_at"))
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(generated)) if generated is not None else "–"
    errors = {rule: error for run in document["runs"] for rule, error in run["evaluation"]["errors"].items()}
    said = "".join(f'<p class="alert">note: {escape(note)}</p>' for note in document.get("notes", ()))
    notes = "".join(f'<p class="alert">rule {escape(rule)} failed on this run ({escape(str(error))}); please report it</p>'
                    for rule, error in errors.items())
    runs = "".join(_run(run, index, len(document["runs"]) > 1) for index, run in enumerate(document["runs"]))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>tuneup report: {source}</title><style>{CSS}</style></head><body>"
            f"<h1>tuneup report: {source}</h1><p class=\"meta\">generated {when} by tuneup "
            f"{escape(str(document.get('tuneup', '')))}</p>{said}{_findings(document)}{runs}{notes}</body></html>\n")
