"""The report as terminal text (rich) and as Markdown."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.padding import Padding
from rich.segment import Segment
from rich.syntax import Syntax
from rich.text import Text

from ..diagnose.rule import MIN_GAIN
from ..format import percent, plural
from . import summary

_STYLE = {"high": "bold red", "medium": "bold yellow", "low": "cyan"}


def ranks_label(finding: dict[str, Any]) -> str:
    ranks = finding.get("ranks") or []
    if len(ranks) > 1:
        return f" (ranks {', '.join(map(str, ranks))})"
    return f" (rank {ranks[0]})" if ranks else ""


WANTS_SHOWN = 4  # reasons a rule could not be checked, the most common first


def checked_summary(document: dict[str, Any]) -> str:
    """One line: how many rules passed, how many could not be checked and for want of what
    (a rule that had no steps to read did not pass)."""
    run = document["runs"][0] if document["runs"] else {}
    evaluation = run.get("evaluation") or {}
    passed, unmeasured = len(evaluation.get("passed", [])), evaluation.get("unmeasured", [])
    steps = ((run.get("snapshot") or {}).get("totals") or {}).get("steps")
    if steps == 0:  # nothing a step shows was measured: the rules that passed read settings only
        return (f"no training step was measured, so {len(unmeasured)} rules could not be checked; {passed} "
                f"checked the job's settings alone and passed")
    wanting = evaluation.get("wanting") or {}
    counts: dict[str, int] = {}
    for rule in unmeasured:
        counts[wanting.get(rule, "its input")] = counts.get(wanting.get(rule, "its input"), 0) + 1
    reasons = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    why = "; ".join(f"{count} wanting {what}" for what, count in reasons[:WANTS_SHOWN])
    if len(reasons) > WANTS_SHOWN:
        why += f"; {sum(count for _, count in reasons[WANTS_SHOWN:])} more"
    text = f"{passed} rules checked and passed"
    slight = evaluation.get("slight") or {}
    if slight:  # crossed their thresholds, but the fix would save next to nothing (rule.MIN_GAIN)
        named = ", ".join(f"{rule} {100 * gain:.1f}%" for rule, gain in sorted(slight.items()))
        text += f" ({len(slight)} of them found a fix worth under {100 * MIN_GAIN:.0f}% of a step: {named})"
    return text + (f", {len(unmeasured)} could not be checked ({why})" if unmeasured else "")


def findings_group(document: dict[str, Any]) -> Group:
    findings = document["findings"]
    parts: list[Any] = []
    if not findings:
        parts.append(Text("No findings: " + checked_summary(document) + ".", style="bold green"))
        return Group(*parts)
    parts.append(Text(f"Advice, ranked by estimated gain ({plural(len(findings), 'finding')}; "
                      f"{checked_summary(document)})", style="bold"))
    for number, finding in enumerate(findings, 1):
        head = Text(f"{number}. ")
        head.append(f"{finding['severity'].upper()} ", style=_STYLE[finding["severity"]])
        head.append(f"{finding['title']}", style="bold")
        head.append(f"  [{finding['rule']}]{ranks_label(finding)}", style="dim")
        lines = [
            Text(f"measured: {finding['observed']}"),
            Text(f"threshold: {finding['threshold']}", style="dim"),
            Text(f"gain: {finding['gain_text']}"),
            Text("fix:"),
        ]
        code = Syntax(finding["fix"], "python", theme="ansi_dark", background_color="default").highlight(finding["fix"])
        code.rstrip()
        parts += [head, Padding(Group(*lines), (0, 0, 0, 3)), Verbatim(code, 5)]
        applied = summary.apply_line(finding)
        if applied:  # green where it is or can be made; what was not kept, in the default colour
            made = applied == summary.CAN_APPLY or (finding.get("applied") or {}).get("decision") in ("kept", "set at start")
            parts.append(Padding(Text(applied, style="green" if made else ""), (0, 0, 0, 3)))
        parts += [Verbatim(Text(f"docs: {finding['doc']}", style="dim"), 3), Text("")]
    return Group(*parts)


class Verbatim:
    """Lines as they are, indented, never wrapped or cropped (printed with crop=False): code to
    copy and links to follow. Wrapped to the console's width (80 columns in a pipe or a CI
    log), a comment's tail became a line of code and a URL two halves."""

    def __init__(self, text: Text, indent: int) -> None:
        self.text, self.indent = text, indent

    def __rich_console__(self, console: Console, options: Any) -> Any:
        for line in self.text.split("\n"):
            yield Segment(" " * self.indent)
            yield from line.render(console)
            yield Segment.line()


def render_text(document: dict[str, Any], console: Console) -> None:
    """The report on `console`, its lines without the spaces rich pads them with to the width."""
    with console.capture() as captured:
        _render_text(document, console)
    console.file.write("\n".join(line.rstrip() for line in captured.get().split("\n")))
    console.file.flush()


def _render_text(document: dict[str, Any], console: Console) -> None:
    console.print(Text(f"tuneup report: {document['source']}", style="bold"))
    for note in document.get("notes", ()):
        console.print(Text(f"note: {note}", style="yellow"))
    console.print(findings_group(document), crop=False)  # (Verbatim: code and links uncut)
    for run in document["runs"]:
        if len(document["runs"]) > 1:
            console.rule(f"rank {run['rank']}")
        if run["snapshot"].get("actions"):
            console.print(summary.changes_group(run["snapshot"]["actions"]))
        console.print(Text("What was measured", style="bold"))
        console.print(summary.render(run["snapshot"]))
    errors = {rule: error for run in document["runs"] for rule, error in run["evaluation"]["errors"].items()}
    for rule, error in errors.items():
        console.print(Text(f"rule {rule} failed on this run ({error}); please report it", style="yellow"))


def to_markdown(document: dict[str, Any]) -> str:
    out = ["# tuneup report", "", f"Source: `{document['source']}`", ""]
    out += [f"> note: {note}" for note in document.get("notes", ())] + ([""] if document.get("notes") else [])
    findings = document["findings"]
    out += ["## Advice, ranked by estimated gain", ""]
    if not findings:
        out += [f"No findings: {checked_summary(document)}.", ""]
    for number, finding in enumerate(findings, 1):
        out += [
            f"### {number}. {finding['title']} — {finding['severity']} (`{finding['rule']}`){ranks_label(finding)}",
            "",
            f"- **Measured:** {finding['observed']}",
            f"- **Threshold:** {finding['threshold']}",
            f"- **Estimated gain:** {finding['gain_text']}",
            f"- **tuneup can apply it:** {'yes (apply mode)' if finding['can_apply'] else 'no (advice only)'}",
            *([f"- **Apply mode in this run:** {summary.apply_line(finding)}"] if finding.get("applied") else []),
            f"- **Docs:** {finding['doc']}",
            "",
            "```python",
            finding["fix"],
            "```",
            "",
        ]
    for run in document["runs"]:
        snapshot = run["snapshot"]
        window = snapshot.get("window")
        rank = f" (rank {run['rank']})" if run["rank"] is not None else ""
        if snapshot.get("actions"):
            out += [f"## Changes tuneup made{rank}", "",
                    "| " + " | ".join(summary.CHANGE_COLUMNS) + " |", "|---|---|---|---:|---:|---:|---:|---|"]
            out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
                    for row in summary.change_rows(snapshot["actions"])]
            net = summary.net_change(snapshot["actions"])
            out += ["", f"**{net}**" if net else "", ""]
        title = "## What was measured" + rank
        out += [title, ""]
        totals = snapshot["totals"]
        out.append(f"{totals['steps']} steps in {totals['seconds']:.1f} s, run `{snapshot['run'].get('run_id')}`, "
                   f"{snapshot['state']}.")
        out.append("")
        if window:
            out += ["| part | median | share of step time |", "|---|---:|---:|",
                    f"| step | {summary.seconds(window['step_seconds']['median'])} | p90 "
                    f"{summary.seconds(window['step_seconds']['p90'])} |"]
            for _, label, middle, share in summary.step_parts(window):
                out.append(f"| {label} | {summary.seconds(middle)} | {percent(share)} |")
            out.append("")
        lines = summary.work_lines(snapshot)
        lines += summary.compile_lines(snapshot.get("compile"), snapshot.get("totals"))
        lines += summary.sync_lines(snapshot["syncs"]) + [summary.scaler_line(snapshot["scaler"])]
        lines += summary.system_lines(snapshot.get("system")) + summary.config_lines(snapshot.get("config"))
        out += [f"- {line.strip()}" for line in lines] + [""]
    return "\n".join(out)
