"""The `tuneup` command line: thin commands over the library (typer + rich).

Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ._version import __version__
from .options import DEFAULT_DAEMON_PORT, parse_host, parse_nvml_module

# torch warns at import when NumPy is absent (tuneup needs none): not the user's concern here.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="tuneup: a live performance-tuning advisor for PyTorch training jobs.",
)


class ReaderLeft(Exception):
    """The reader of stdout left (`tuneup rules | head`): main() exits as a shell reports a
    writer that SIGPIPE ended. Not an OSError: typer turns an EPIPE OSError into exit 1
    (typer/core.py, _main), and rich does too (rich/console.py, Console.on_broken_pipe),
    the code tuneup keeps for its own bugs."""


class _Console(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise ReaderLeft


def _out(text: str) -> None:
    """Text to stdout, flushed here: a pipe closed at exit's flush would not reach main()."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise ReaderLeft from None


console = _Console()
errors = Console(stderr=True)


def _seconds(option: str, value: float, low: float, high: float) -> float:
    """A number of seconds in [low, high]. Not typer's min/max: nan fails both of their
    comparisons and was told "should be <= 60"; here it is named as not a number."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a number of seconds: give one from {low:g} to {high:g}",
                                 param_hint=f"'{option}'")
    if not low <= value <= high:
        raise typer.BadParameter(f"{value:g} seconds is out of range: give one from {low:g} to {high:g}",
                                 param_hint=f"'{option}'")
    return value


# Exit codes (README, "Use it"): 1 is kept for tuneup's own bugs.
USAGE = 2  # what the user typed or pointed at
DOCTOR_FAILED = 3  # `tuneup doctor`: a check failed
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
PIPE_CLOSED = 141  # 128 + SIGPIPE, as a shell reports `yes | head`


class UserError(Exception):
    """A problem the user can fix; printed as one line."""


try:  # typer >= 0.29 vendors click and exposes its errors' base class
    from typer.exceptions import TyperException as CommandLineError
except ImportError:  # older typer raises click's own
    from click import ClickException as CommandLineError  # type: ignore[assignment]


def _version(value: bool) -> None:
    if value:
        console.print(f"tuneup {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Measure where a training step's time goes, explain it, and fix what is safe to fix."""


@app.command()
def demo(
    steps: int = typer.Option(400, min=10, max=100_000, help="Optimizer steps to run."),
    run_dir: Optional[Path] = typer.Option(None, help="Where to write the run log (default ./tuneup-runs/<run>)."),
    workers: int = typer.Option(0, min=0, max=64, help="DataLoader workers (0 shows the data stall)."),
    apply: bool = typer.Option(False, "--apply", help="Let tuneup fix what is safe to fix, as measured experiments."),
) -> None:
    """Run the built-in CPU training job with real bottlenecks, measured by tuneup, then print the report."""
    import tuneup
    from . import demo as demo_job
    from .report.text import render_text

    problem = _run_dir_problem(run_dir) if run_dir is not None else None
    if problem:
        raise UserError(f"--run-dir {run_dir} {problem}: name a directory to write the run log in (it may not exist yet)")
    console.print(
        f"tuneup demo: a small conv net on slowly decoded images, num_workers={workers}, "
        f"{demo_job.HOST_READS} .item() calls per step, GradScaler with a few unnormalized records ({steps} steps)."
    )
    if apply:
        console.print("apply mode: tuneup changes what is safe to change while the job trains, measures each "
                      "change against the steps before it, and keeps it only if it helps.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's CPU GradScaler notes; ours print below
        agent = tuneup.attach(run_dir=run_dir, mode="apply" if apply else "advise")
        if agent.server is not None:
            console.print(f"live while it trains: tuneup watch {agent.server.url}   (Prometheus: {agent.server.url}/metrics)",
                          soft_wrap=True)
        try:
            with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TextColumn("loss {task.fields[loss]:.3f}  {task.fields[live]}"), console=console,
                          transient=True) as bar:
                task = bar.add_task("train", total=steps, loss=float("nan"), live="")
                demo_job.train(steps, num_workers=workers, progress=_live_progress(agent, bar, task))
        finally:
            agent.detach()
    render_text(agent.document(), console)
    if agent.run_dir is not None:  # None when the run log could not be written (the warning said why)
        console.print(f"This report again: tuneup report {agent.run_dir}", soft_wrap=True)


LIVE_EVERY = 1.0  # seconds between the demo's live line's readings of the agent


def _live_progress(agent: Any, bar: Any, task: Any) -> Any:
    """The demo's progress callback: the bar's step and loss at every step, and about once a
    second the agent's live line (report/summary.py live_line: step, stall, FLOP/s, MFU, the
    top finding), read off its snapshot."""
    from .report.summary import live_line

    read_at = [time.monotonic() + LIVE_EVERY]

    def progress(step: int, loss: float) -> None:
        fields = {"completed": step, "loss": loss}
        if time.monotonic() >= read_at[0]:
            read_at[0] = time.monotonic() + LIVE_EVERY
            fields["live"] = live_line(agent.snapshot(), agent.findings())
        bar.update(task, **fields)

    return progress


RUNS = Path("tuneup-runs")  # where runs go by default (options.py default_run_dir)


def _run_dir_problem(folder: Path) -> str | None:
    """Why the run log cannot go to `folder` (it, or the nearest folder above it that exists,
    is a file or cannot be read), or None."""
    from .export import discovery

    for path in (folder, *folder.absolute().parents):
        problem = discovery.folder_problem(path)
        if problem:
            return problem if path == folder else f"cannot be made: {path} {problem}"
        try:
            if path.exists():
                return None
        except OSError as exc:  # pragma: no cover - folder_problem read it a moment ago
            return f"cannot be read: {exc.strerror or exc}"
    return None


def _default_run() -> tuple[Path, str]:
    """The run `tuneup report` reads when given none, and how to name it: the run directory
    TUNEUP_RUN_DIR names, where it is set (the agent wrote there), else the newest run
    directory under ./tuneup-runs that holds a run log."""
    named = os.environ.get("TUNEUP_RUN_DIR", "").strip()
    if named:
        folder = Path(named).expanduser()
        if not (folder.is_dir() and any(folder.glob("events*.jsonl"))):
            raise UserError(f"no run given, and TUNEUP_RUN_DIR ({named}) holds no run log: pass one (tuneup report "
                            "RUN_DIR, a run log file or an agent's URL), or unset TUNEUP_RUN_DIR to read the newest "
                            f"run under ./{RUNS}")
        return folder, "the run in TUNEUP_RUN_DIR"
    newest = _newest_run(RUNS)
    if newest is None:
        raise UserError(f"no run given and no run log under ./{RUNS}: pass one (tuneup report RUN_DIR, a run log file "
                        "or an agent's URL)")
    return newest, "the newest run"


def _newest_in_runs_folder(folder: Path) -> Path | None:
    """Where `folder` is a folder of run directories (./tuneup-runs) holding no run log of its
    own: its newest run; else None."""
    try:
        return None if any(folder.glob("events*.jsonl")) else _newest_run(folder)
    except OSError:
        return None


def _newest_run(parent: Path) -> Path | None:
    """The run directory under `parent` whose run log was written last (None: none holds one)."""
    try:
        runs = [folder for folder in (parent.iterdir() if parent.is_dir() else ())
                if folder.is_dir() and any(folder.glob("events*.jsonl"))]
        return max(runs, key=lambda folder: max(log.stat().st_mtime for log in folder.glob("events*.jsonl")),
                   default=None)
    except OSError:  # unreadable: the reader says why
        return None


def _check_rules(ids: list[str]) -> tuple[str, ...]:
    from .diagnose.engine import unknown_rules

    unknown = unknown_rules(ids)
    if unknown:
        raise UserError(f"unknown rule id {unknown[0]!r} for --silence (see `tuneup rules` for the ids)")
    return tuple(ids)


@app.command()
def report(
    targets: Optional[list[str]] = typer.Argument(None, metavar="TARGET",
                                                  help="A run directory, a run log file, or the URL of a live agent or "
                                                       "node daemon; several: one job's run directories from its "
                                                       "nodes, merged. A folder of runs: its newest. None: "
                                                       "TUNEUP_RUN_DIR's run where it is set, else the newest run "
                                                       "under ./tuneup-runs."),
    format: str = typer.Option("text", "--format", "-f", help="text, markdown, json or html."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the report to this file."),
    silence: list[str] = typer.Option([], "--silence", help="A rule id to leave out (repeatable)."),
    window: int = typer.Option(1000, min=10, max=1_000_000, help="Steps in the window the rules read."),
) -> None:
    """Ranked advice for a run (finished or live), with the measured evidence and the fix.
    Against a node daemon's URL: every job running on that node."""
    from .report.document import build
    from .report.render import FORMATS, render_document
    from .report.sources import ReportSourceError, load_merged

    if format not in FORMATS:
        raise UserError(f"unknown --format {format!r}: use one of {', '.join(FORMATS)}")
    silenced = _check_rules(silence)
    chosen = None
    if not targets:
        folder, chosen = _default_run()
        targets = [str(folder)]
    elif len(targets) == 1 and (folder := _newest_in_runs_folder(Path(targets[0]))) is not None:
        chosen, targets = f"the newest run under {targets[0]}", [str(folder)]  # ./tuneup-runs itself
    if chosen:
        if output is not None or format != "text":  # (the text report's own first line names it)
            # On stderr: stdout is the document (`tuneup report --format json | jq`).
            errors.print(f"tuneup report: {chosen}, {targets[0]}", style="dim", soft_wrap=True)
    try:
        jobs = load_merged(targets)
    except ReportSourceError as exc:
        raise UserError(str(exc)) from None
    target = " + ".join(targets)
    if format == "html" and len(jobs) > 1:
        raise UserError(f"{target} serves {len(jobs)} jobs and an html report shows one: pass one job's URL "
                        f"({'; '.join(source.split(', ')[0] for _, source in jobs)})")
    documents = [build(histories, source=source, silence=silenced, window_steps=window) for histories, source in jobs]
    if output is None and format == "text":
        from .report.text import render_text

        for index, document in enumerate(documents, start=1):
            if len(documents) > 1:
                console.rule(f"job {index} of {len(documents)}: {document['source']}", style="bold")
            if chosen:
                document = dict(document, source=f"{document['source']} ({chosen})")
            render_text(document, console)
        return
    if len(documents) == 1:
        text = render_document(documents[0], format)
    elif format == "json":
        text = render_document({"jobs": documents}, "json")  # type: ignore[arg-type]
    else:
        text = "\n\n".join(render_document(document, format) for document in documents)
    if output is None:
        _out(text + "\n")
        return
    try:
        output.write_text(text + ("\n" if not text.endswith("\n") else ""), encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot write {output}: {exc.strerror or exc} (choose another -o path)") from None
    errors.print(f"tuneup: wrote the {format} report to {output}", highlight=False)


@app.command()
def watch(
    url: Optional[str] = typer.Argument(None, help="A live agent's URL (default: the one job running here)."),
    interval: float = typer.Option(2.0, callback=lambda value: _seconds("--interval", value, 0.2, 60.0),
                                   help="Seconds between refreshes (0.2 to 60)."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
) -> None:
    """A live view of a running job: the step breakdown and the current findings, refreshing."""
    from .report.live import watch as run_watch
    from .report.sources import ReportSourceError

    try:
        run_watch(url, console, interval=interval, once=once)
    except ReportSourceError as exc:
        raise UserError(str(exc)) from None


@app.command()
def doctor() -> None:
    """Check the environment: torch, CUDA, cuDNN, NVML and driver, TF32, bf16, CPU, tuneup's own needs."""
    from .report.doctor import run_checks

    failed = run_checks(console)
    if failed:
        raise typer.Exit(DOCTOR_FAILED)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})
def run(
    ctx: typer.Context,
    target: str = typer.Argument(..., metavar="TARGET", help="The training script (or, with -m, a module)."),
    module: bool = typer.Option(False, "-m", help="TARGET is a module, run as `python -m TARGET`."),
    apply: bool = typer.Option(False, "--apply", help="Apply safe changes as measured experiments."),
    actions: Optional[str] = typer.Option(None, "--actions", help="With --apply: the actions allowed, "
                                          "comma-separated (default: all; see `tuneup actions`)."),
) -> None:
    """Run a training script with the agent attached, no code change: `tuneup run train.py --lr 0.1`.

    The script's arguments, exit code and exceptions are its own. Options for tuneup go
    before the script (or into TUNEUP_* environment variables)."""
    from .launch import LaunchError, exec_script
    from .launch.command import run_environment

    if target.startswith("-") and not os.path.lexists(target):  # an option this command does not have
        raise UserError(f"no option {target} for tuneup run: its options are -m, --apply and --actions, before "
                        "the script (see 'tuneup run --help'); the script's own options go after it")
    try:
        overrides = run_environment(apply, actions)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        exec_script(target, list(ctx.args), module=module, env_overrides=overrides)
    except LaunchError as exc:
        raise UserError(str(exc)) from None


@app.command()
def daemon(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface, for Prometheus "
                             "on another machine)."),
    port: int = typer.Option(DEFAULT_DAEMON_PORT, min=0, max=65535, help="Port to listen on (0: any free port, "
                             "printed at start)."),
    registry_dir: Optional[Path] = typer.Option(None, help="Where agents announce themselves (default: "
                                                "TUNEUP_REGISTRY_DIR, else this user's runtime directory)."),
    gpu: bool = typer.Option(True, "--gpu/--no-gpu", help="Export the node's GPUs (NVML) too."),
) -> None:
    """The node daemon: one Prometheus endpoint for every tuneup job on this node, plus the node's GPUs.

    `tuneup report` and `tuneup watch` against its URL cover every running job."""
    import errno
    import logging
    import signal
    import socket
    import threading

    from .export import discovery
    from .export.daemon import NodeDaemon

    try:
        host = parse_host(host)  # the agent's TUNEUP_HOST rule: empty is not "every interface"
    except ValueError as exc:
        raise UserError(f"--host is empty: {exc}") from None
    problem = discovery.folder_problem(registry_dir) if registry_dir is not None else None
    if problem:
        raise UserError(f"--registry-dir {registry_dir} {problem}: give the directory agents announce themselves in")
    try:
        nvml_module = parse_nvml_module(os.environ.get("TUNEUP_NVML_MODULE", "pynvml"))
    except ValueError as exc:
        raise UserError(f"TUNEUP_NVML_MODULE: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="tuneup daemon: %(message)s")
    folder = registry_dir or discovery.directory()
    node = NodeDaemon(folder, nvml_module=nvml_module, gpu=gpu)
    try:
        url = node.start(host, port)
    except OSError as exc:
        node.stop()
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"--host {host} is not an address of this machine ({exc.strerror or exc}): give one "
                            "of its addresses, e.g. 127.0.0.1 (the default) or 0.0.0.0 for every interface") from None
        reason = "is in use (another tuneup daemon?)" if exc.errno == errno.EADDRINUSE else f"cannot be used ({exc.strerror or exc})"
        raise UserError(f"port {port} on {host} {reason}: choose another with --port") from None
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    console.print(f"tuneup daemon: serving every tuneup job on this node at {url}/metrics "
                  f"(agents announce themselves in {folder}; {len(node.agents())} running now)", highlight=False,
                  soft_wrap=True)
    console.print(f"  tuneup report {url}    tuneup watch {url}", highlight=False, soft_wrap=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        node.stop()
        console.print("tuneup daemon: stopped", highlight=False)


@app.command()
def rules(
    format: str = typer.Option("text", "--format", "-f", help="text or markdown."),
) -> None:
    """The advice rules: ids (for --silence / TUNEUP_SILENCE), thresholds and why."""
    from .diagnose import RULES

    if format not in ("text", "markdown"):
        raise UserError(f"unknown --format {format!r}: use text or markdown")
    if format == "markdown":
        _out(rules_markdown())
        return
    for rule in RULES.values():
        console.print(f"[bold]{rule.id}[/bold] ({rule.severity}{', applicable' if rule.can_apply else ''}): {rule.title}",
                      highlight=False)
        console.print(f"    threshold: {rule.threshold}", highlight=False, markup=False)
        console.print(f"    why: {rule.why}", highlight=False, markup=False)


@app.command(name="actions")
def list_actions() -> None:
    """What apply mode can change (ids for --actions / TUNEUP_ACTIONS), and which findings start each."""
    from .act.actions import ACTIONS

    for action in ACTIONS.values():
        console.print(f"[bold]{action.id}[/bold]: {action.title}", highlight=False)
        console.print(f"    started by the findings: {', '.join(action.fixes)}", highlight=False, markup=False)
        console.print(f"    {action.summary}", highlight=False, markup=False)


def rules_markdown() -> str:
    from .diagnose import RULES

    lines = ["# tuneup advice rules", "",
             "Generated by `tuneup rules --format markdown`. Silence a rule with `--silence ID` or "
             "`TUNEUP_SILENCE=id,id`.", ""]
    for rule in RULES.values():
        lines += [f"## `{rule.id}` — {rule.title}", "",
                  f"- **Severity:** {rule.severity}",
                  f"- **Inputs:** {rule.inputs}",
                  f"- **Threshold:** {rule.threshold}",
                  f"- **Why this threshold:** {rule.why}",
                  f"- **tuneup can apply the fix:** {'yes' if rule.can_apply else 'no'}",
                  f"- **Docs:** {rule.doc}", ""]
    return "\n".join(lines)


def _fail(message: str, code: int) -> None:
    from .format import one_line

    errors.print(f"tuneup: {one_line(message)}", style="red", highlight=False, markup=False, soft_wrap=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point: click's usage errors and our own become one line, never a traceback."""
    try:
        code = app(args=argv, standalone_mode=False)
    except CommandLineError as exc:  # bad usage: unknown command, out-of-range option, ...
        if not exc.format_message().strip():
            sys.exit(0)  # `tuneup` alone: the help was printed
        context = getattr(exc, "ctx", None)
        hint = f" (see '{context.command_path} --help')" if context is not None else ""
        _fail(f"{exc.format_message()}{hint}", getattr(exc, "exit_code", USAGE))
    except UserError as exc:
        _fail(str(exc), USAGE)
    except (KeyboardInterrupt, typer.Abort):
        _fail("interrupted", INTERRUPTED)
    except (ReaderLeft, BrokenPipeError):  # `tuneup ... | head`: the reader left; leave quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(PIPE_CLOSED)
    except Exception as exc:  # a bug of ours: still one line, with what to report
        _fail(f"internal error: {type(exc).__name__}: {exc} (please report it with the command you ran)", 1)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
