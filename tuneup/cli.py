"""The `tuneup` command line: thin commands over the library (typer + rich).

Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import __version__

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="tuneup: a live performance-tuning advisor for PyTorch training jobs.",
)
console = Console()
errors = Console(stderr=True)


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
) -> None:
    """Run the built-in CPU training job with real bottlenecks, measured by tuneup."""
    import tuneup
    from . import demo as demo_job
    from .report.summary import print_summary

    console.print(
        f"tuneup demo: a small conv net on slowly decoded images, num_workers={workers}, "
        f"three .item() calls per step, GradScaler with a few unnormalized records ({steps} steps)."
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's CPU GradScaler notes; ours print below
        agent = tuneup.attach(run_dir=run_dir)
        try:
            with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TextColumn("loss {task.fields[loss]:.3f}"), console=console, transient=True) as bar:
                task = bar.add_task("train", total=steps, loss=float("nan"))
                demo_job.train(steps, num_workers=workers,
                               progress=lambda step, loss: bar.update(task, completed=step, loss=loss))
        finally:
            agent.detach()
    print_summary(agent.snapshot(), console)


def _fail(message: str, code: int) -> None:
    errors.print(f"tuneup: {message}", style="red", highlight=False, markup=False, soft_wrap=True)
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
        _fail(f"{exc.format_message()}{hint}", getattr(exc, "exit_code", 2))
    except UserError as exc:
        _fail(str(exc), 2)
    except (KeyboardInterrupt, typer.Abort):
        _fail("interrupted", 130)
    except BrokenPipeError:  # `tuneup ... | head`: the reader left; leave quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as exc:  # a bug of ours: still one line, with what to report
        _fail(f"internal error: {type(exc).__name__}: {exc} (please report it with the command you ran)", 1)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
