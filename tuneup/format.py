"""Human-readable numbers, shared by the rules' evidence sentences and the reports."""

from __future__ import annotations

import re

from .redact import url


def seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"


def plural(number: int, noun: str, plurals: str | None = None) -> str:
    """"1 finding", "3 findings", "1,200 steps"."""
    return f"{number:,} {noun if number == 1 else plurals or noun + 's'}"


def size(value: float | None) -> str:
    if value is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "–"


def flops(value: float | None, unit: str = "FLOP") -> str:
    """A FLOP count (or, with unit "FLOP/s", a rate) with an SI prefix: 192.5 kFLOP, 38.1 TFLOP/s."""
    if value is None:
        return "–"
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(value) < 1000 or prefix == "P":
            return f"{value:.0f} {unit}" if not prefix else f"{value:.1f} {prefix}{unit}"
        value /= 1000
    return "–"


def percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def read_rate(source: dict) -> str:
    """How often a host-read source reads: "1.0/step" when it reads on (nearly) every sampled
    step, else "3 reads on 2 of 40 sampled steps" (evaluation, logging every N steps): a
    per-step average of a read that comes in bursts would name a rate no step has. A source
    from an older or damaged run log (no counts, or counts of the wrong type) gets its rate."""
    rate, steps, out_of = source.get("per_step"), source.get("steps"), source.get("out_of")
    if not isinstance(rate, (int, float)) or rate != rate:
        return "–"
    if not (isinstance(steps, int) and isinstance(out_of, int)) or not 0 < steps < 0.9 * out_of:
        return f"{rate:.1f}/step"
    reads = round(rate * out_of / steps, 1)
    return f"{reads:g} read{'s' if reads != 1 else ''} on {steps} of {out_of} sampled steps"


LONGEST_QUOTED = 200  # characters of one unbroken run of what the user typed, quoted in an error


def one_line(text: str) -> str:
    """`text` as one line of an error that quotes what the user typed: control characters
    (newlines, escapes, separators) written as escapes, so it stays one line and cannot drive
    the terminal; the user information of any URL in it hidden (redact.url); an unbroken run
    over LONGEST_QUOTED characters (a 5,000-character path, a 100 KB URL) cut in the middle."""
    text = "".join(char if char.isprintable() else repr(char)[1:-1] for char in url(text))
    return re.sub(r"\S{%d,}" % (LONGEST_QUOTED + 1),
                  lambda match: f"{match[0][:80]}…[{len(match[0]):,} characters]…{match[0][-80:]}", text)


def set_by_apply_mode(loader: dict) -> str:
    """A DataLoader's settings apply mode made, from its configuration's `set_by_tuneup` (the
    job's own values): "set by apply mode: num_workers (the job's own: 0)", or "" for none."""
    tuned = loader.get("set_by_tuneup")
    if not isinstance(tuned, dict) or not tuned:
        return ""
    return "set by apply mode: " + ", ".join(f"{knob} (the job's own: {own})" for knob, own in tuned.items())
