"""The html report: one self-contained page with the findings and inline SVG plots, built
from a real short training run's report document (no mocks), and drawn by a real headless
Chromium where one is installed."""

from __future__ import annotations

import copy
import html
import math
import re
import shutil
import struct
import subprocess
import time
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tuneup
from tuneup.report.document import build
from tuneup.report.html import PARTS, to_html
from tuneup.report.sources import load

PLOT_IDS = ("plot-step-breakdown", "plot-stall", "plot-scaler", "plot-gpu")
VOID = {"meta", "br", "hr", "img", "input", "link", "wbr"}
NUMERIC = {"x", "y", "x1", "x2", "y1", "y2", "cx", "cy", "r", "width", "height"}
OVERFLOW_STEPS = {60, 61, 100}


class SleepyDataset(TensorDataset):
    """A TensorDataset whose items take ~1 ms to read: the loop visibly waits for data."""

    def __getitem__(self, index):
        time.sleep(0.001)
        return super().__getitem__(index)


@pytest.fixture(scope="module")
def document(tmp_path_factory) -> dict:
    """The report document of a real 150-step run with a data stall and GradScaler skips (with
    clipping and an lr schedule, so the findings, and the page's length, vary little)."""
    torch.manual_seed(0)
    run_dir = tmp_path_factory.mktemp("html") / "run"
    loader = DataLoader(SleepyDataset(torch.randn(600, 16), torch.randn(600, 1)), batch_size=4)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=20)
    with tuneup.attach(run_dir=run_dir, interval=0.05, port=0):
        for step, (x, y) in enumerate(loader, 1):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if step in OVERFLOW_STEPS:
                loss = loss * float("inf")  # an fp16-style overflow: the scaler skips this step
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
    histories, source = load(str(run_dir))
    return build(histories, source=source)


class Page(HTMLParser):
    """The parsed page: every element (tag, attributes, enclosing plot id) and the text
    outside <pre>; fails on a mismatched end tag."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str], str | None]] = []
        self.text: list[str] = []
        self.open: list[tuple[str, str | None]] = []
        self.feed(text)
        self.close()
        assert not self.open, f"unclosed elements: {self.open}"

    def plot(self) -> str | None:
        return next((plot for _, plot in reversed(self.open) if plot), None)

    def handle_starttag(self, tag, attrs):
        attributes = {name: value or "" for name, value in attrs}
        plot = attributes.get("id") if "plot" in attributes.get("class", "").split() else None
        self.elements.append((tag, attributes, plot or self.plot()))
        if tag not in VOID:
            self.open.append((tag, plot))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, {name: value or "" for name, value in attrs}, self.plot()))

    def handle_endtag(self, tag):
        assert self.open and self.open[-1][0] == tag, f"</{tag}> closes {self.open[-1:]}"
        self.open.pop()

    def handle_data(self, data):
        if not any(tag == "pre" for tag, _ in self.open):
            self.text.append(data)

    def by_id(self, ident: str) -> tuple[str, dict[str, str]]:
        found = [(tag, attrs) for tag, attrs, _ in self.elements if attrs.get("id") == ident]
        assert len(found) == 1, f"{len(found)} elements with id {ident}"
        return found[0]

    def inside(self, plot: str, tag: str) -> list[dict[str, str]]:
        return [attrs for name, attrs, where in self.elements if where == plot and name == tag]


def points(attrs: dict[str, str]) -> list[tuple[float, float]]:
    pairs = [pair.split(",") for pair in attrs["points"].split()]
    assert all(len(pair) == 2 for pair in pairs)
    out = [(float(x), float(y)) for x, y in pairs]
    assert all(math.isfinite(x) and math.isfinite(y) for x, y in out)
    return out


def assert_numbers_finite(page: Page) -> None:
    for tag, attrs, _ in page.elements:
        for name in NUMERIC & attrs.keys():
            assert math.isfinite(float(attrs[name])), f"<{tag} {name}={attrs[name]!r}>"
        if "points" in attrs:
            points(attrs)
    assert not re.search(r"\b(nan|inf|infinity)\b", " ".join(page.text), re.IGNORECASE)


def test_real_run_renders_findings_tables_and_plots(document):
    findings = {finding["rule"]: finding for finding in document["findings"]}
    assert "data-stall" in findings  # the sleeping dataset made the loop wait
    text = to_html(document)
    page = Page(text)
    assert html.escape(findings["data-stall"]["observed"]) in text
    assert "tuneup's apply mode can make it as a measured experiment" in text, findings["data-stall"]  # can be applied
    assert text.count('<pre><code class="language-python">') == len(findings)

    for ident in PLOT_IDS[:3]:
        tag, attrs = page.by_id(ident)
        assert tag == "figure" and ident in attrs["class"]
        assert page.inside(ident, "svg")[0]["viewbox"].startswith("0 0 ")
        assert page.inside(ident, "title") and page.inside(ident, "figcaption")
    tag, attrs = page.by_id("plot-gpu")  # a CPU-only run
    assert tag == "p" and "note" in attrs["class"].split()
    assert "no GPU measured" in text

    areas = [a for a in page.inside("plot-step-breakdown", "polygon") if "series" in a.get("class", "")]
    assert [a["data-series"] for a in areas] == [key for key, _, _ in PARTS]
    series = document["runs"][0]["series"]
    edges = 2 * len(series["step"])  # each interval's start and end, along the top and back along the bottom
    outlines = [points(area) for area in areas]
    assert all(len(outline) == 2 * edges for outline in outlines)
    assert len({y for _, y in outlines[0][edges:]}) == 1  # data wait sits on the x axis
    for below, above in zip(outlines, outlines[1:]):  # each part sits on the one below it
        assert above[edges:][::-1] == below[:edges]
    assert min(y for _, y in outlines[-1][:edges]) < outlines[0][edges][1]

    stall = page.inside("plot-stall", "polyline")
    assert len(stall) == 1 and len(points(stall[0])) == len(series["step"])
    skips = page.inside("plot-scaler", "rect")
    assert len([r for r in skips if r.get("class") == "skips"]) >= 1  # the injected overflows
    assert len(points(page.inside("plot-scaler", "polyline")[0])) == len(series["step"])

    # Self-contained: no script, stylesheet, font or image is loaded; links are the docs' only.
    assert not any("src" in attrs for _, attrs, _ in page.elements)
    assert {tag for tag, attrs, _ in page.elements if "href" in attrs} == {"a"}
    assert not re.search(r"<script|<link|@import|url\(", text, re.IGNORECASE)
    assert_numbers_finite(page)


def test_the_learning_rate_is_drawn_as_the_job_ran_it(document):
    """StepLR(step_size=50) from 0.01: 0.01, 0.001, 0.0001 over the 150 steps, held between
    changes (the run log's end event holds the curve)."""
    [curve] = document["runs"][0]["series"]["learning_rates"]
    rates = [lr for _, lr in curve["curve"]]
    assert rates == pytest.approx([0.01, 0.001, 0.0001])
    page = Page(to_html(document))
    tag, _ = page.by_id("plot-learning-rate")
    assert tag == "figure"
    [line] = [a for a in page.inside("plot-learning-rate", "polyline") if a.get("data-series") == "SGD lr"]
    drawn = points(line)
    assert len(drawn) == 2 * len(rates)  # a step shape: each rate held until the next change
    assert len({y for _, y in drawn}) == 3 and [y for _, y in drawn] == sorted(y for _, y in drawn)  # falls twice


def test_nonfinite_and_missing_values_are_left_out_of_plots(document):
    doc = copy.deepcopy(document)
    series = doc["runs"][0]["series"]
    series["stall_ratio"][1] = float("nan")
    series["stall_ratio"][2] = "inf"  # what a JSON round trip leaves
    series["scale"][0] = None
    series["data_wait"][0] = float("inf")
    doc["runs"][0]["snapshot"]["window"]["loss"]["last"] = float("nan")
    page = Page(to_html(doc))
    assert len(points(page.inside("plot-stall", "polyline")[0])) == len(series["step"]) - 2
    assert len(points(page.inside("plot-scaler", "polyline")[0])) == len(series["step"]) - 1
    assert_numbers_finite(page)


def test_gpu_series_render_a_gpu_plot(document):
    doc = copy.deepcopy(document)
    series = doc["runs"][0]["series"]
    count = len(series["time"])
    series["gpu_time"] = list(series["time"])
    series["gpu_utilization"] = [0.5 + 0.4 * math.sin(i) for i in range(count)]
    series["gpu_memory_ratio"] = [0.3 + 0.01 * i for i in range(count)]
    series["gpu_power_watts"] = [200.0] * count
    page = Page(to_html(doc))
    tag, _ = page.by_id("plot-gpu")
    assert tag == "figure"
    lines = page.inside("plot-gpu", "polyline")
    assert [line["data-series"] for line in lines] == ["utilization %", "memory used %"]
    for line, values in zip(lines, (series["gpu_utilization"], series["gpu_memory_ratio"])):
        ys = [y for _, y in points(line)]
        assert len(ys) == count
        # higher values are drawn higher (smaller y): the axis maps 0-100% the right way up
        assert ys[values.index(max(values))] == min(ys)


def test_document_strings_are_escaped(document):
    doc = copy.deepcopy(document)
    doc["source"] = "/runs/<b>bold</b>"
    doc["findings"][0].update(observed="waited <script>alert(1)</script> & more", doc="javascript:alert(1)")
    text = to_html(doc)
    assert "<script>" not in text and "<b>bold" not in text
    assert "waited &lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in text
    assert "/runs/&lt;b&gt;bold&lt;/b&gt;" in text
    assert 'href="javascript' not in text  # only http(s) doc links become links
    Page(text)


def test_no_findings_no_scaler_and_several_ranks(document):
    doc = copy.deepcopy(document)
    doc["findings"] = []
    run = doc["runs"][0]
    run["snapshot"]["scaler"] = {"present": False}
    doc["runs"] = [dict(copy.deepcopy(run), rank=rank) for rank in (0, 1)]
    text = to_html(doc)
    page = Page(text)
    assert "No findings:" in text and 'class="finding ' not in text
    ids = [attrs["id"] for _, attrs, _ in page.elements if "id" in attrs]
    assert len(ids) == len(set(ids))
    for rank in (0, 1):
        assert f"What was measured (rank {rank})" in text
        for ident in PLOT_IDS:
            page.by_id(f"{ident}-rank-{rank}")
        tag, _ = page.by_id(f"plot-scaler-rank-{rank}")
        assert tag == "p"
    assert text.count("GradScaler: none in this job: no loss-scale plot") == 2


def read_png(path: Path) -> tuple[int, int, int, bytes]:
    """(width, height, bytes per pixel, pixel rows) of an 8-bit RGB or RGBA non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    position, chunks, header = 8, [], b""
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position : position + 8])
        body = data[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        position += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and interlace == 0, "unsupported PNG layout"
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(chunks)), width * bpp
    previous, rows = bytearray(stride), []
    for row in range(height):
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        unfilter(kind, line, previous, bpp)
        rows.append(bytes(line))
        previous = line
    return width, height, bpp, b"".join(rows)


def unfilter(kind: int, line: bytearray, previous: bytearray, bpp: int) -> None:
    """Undo one row's PNG filter in place (filter types 0-4)."""
    if kind == 1:
        for i in range(bpp, len(line)):
            line[i] = (line[i] + line[i - bpp]) & 255
    elif kind == 2:
        line[:] = bytes((a + b) & 255 for a, b in zip(line, previous))
    elif kind == 3:
        for i in range(len(line)):
            line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + previous[i]) // 2) & 255
    elif kind == 4:
        for i in range(len(line)):
            a, b = (line[i - bpp] if i >= bpp else 0), previous[i]
            c = previous[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    else:
        assert kind == 0, f"bad PNG filter {kind}"


def count_colour(pixels: bytes, bpp: int, colour: str) -> int:
    """Pixels of exactly this #rrggbb colour (opaque when the image has alpha)."""
    wanted = bytes.fromhex(colour[1:]) + (b"\xff" if bpp == 4 else b"")
    view = memoryview(pixels)
    return sum(1 for i in range(0, len(pixels), bpp) if view[i : i + bpp] == wanted)


BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(name)), None)


@pytest.mark.skipif(BROWSER is None, reason="no chromium, chromium-browser or google-chrome on PATH "
                                              "(apt-get install chromium) to screenshot the report")
def test_headless_chromium_draws_the_plots(document, tmp_path):
    page, png = tmp_path / "report.html", tmp_path / "report.png"
    page.write_text(to_html(document), encoding="utf-8")
    subprocess.run([BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--force-color-profile=srgb", "--window-size=1200,2400", f"--screenshot={png}",
                    page.as_uri()], check=True, capture_output=True, timeout=60)
    width, height, bpp, pixels = read_png(png)
    assert (width, height) == (1200, 2400)
    counts = {key: count_colour(pixels, bpp, colour) for key, _, colour in PARTS}
    # The stacked areas are opaque, so drawn areas are exact pixels of their colour; the table's
    # and legend's swatches add only ~250 pixels per colour. The loop mostly waits for data:
    assert counts["data_wait"] > 20_000, counts
    # Thin bands above it: more of their colours than the swatches alone (how thin depends on
    # the machine: a loaded one stretched the wait to ~95% of the steps, 1,674 pixels in all).
    assert sum(counts.values()) - counts["data_wait"] > 250 * (len(PARTS) - 1), counts
