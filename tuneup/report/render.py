"""One entry point for every report format: `render_document(document, format)`."""

from __future__ import annotations

import io
import json
from typing import Any

from rich.console import Console

from ..export.runlog import json_safe
from .text import render_text, to_markdown

FORMATS = ("text", "markdown", "json", "html")


def render_document(document: dict[str, Any], format: str, *, width: int = 100, color: bool = False) -> str:
    if format == "json":
        return json.dumps(json_safe(document), indent=2, default=str, allow_nan=False)
    if format == "markdown":
        return to_markdown(document)
    if format == "html":
        from .html import to_html

        return to_html(document)
    if format == "text":
        buffer = io.StringIO()
        render_text(document, Console(file=buffer, width=width, force_terminal=color, color_system="standard" if color else None))
        return buffer.getvalue()
    raise ValueError(f"unknown report format {format!r}: use one of {', '.join(FORMATS)}")

