"""report.html and its figures: every image the page references exists and is a valid PNG,
built from real study, frontier, campaign and demo outputs of short real-model runs (and
from synthetic results for the page machinery)."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from conftest import one_line_error, run_cli
from statelab.report import PNG_MAGIC, Page, figures, referenced_images

REPO = Path(__file__).resolve().parents[1]
THREADS = {"STATELAB_THREADS": "1"}


def check_png(path: Path) -> tuple[int, int]:
    """A valid PNG: signature, every chunk's CRC, IHDR first, IEND last, the image data
    inflates to the size the header promises.  Returns (width, height)."""
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), f"{path} is not a PNG"
    pos, chunks, idat = 8, [], b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind!r}"
        chunks.append(kind)
        if kind == b"IDAT":
            idat += body
        pos += 12 + n
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks, chunks
    ihdr = data[16:29]
    w, h, depth, colour = struct.unpack(">IIBB", ihdr[:10])
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]
    assert len(zlib.decompress(idat)) == h * (1 + w * channels * depth // 8)
    assert w > 50 and h > 50
    return w, h


def check_page(folder: Path, expect_figures: int) -> str:
    """report.html exists, references at least ``expect_figures`` images, each a valid PNG
    inside the folder; returns the page."""
    page = (folder / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    srcs = referenced_images(page)
    assert len(srcs) >= expect_figures, srcs
    for src in srcs:
        assert not src.startswith(("/", "http:", "https:", "data:")), src
        path = (folder / src).resolve()
        assert path.is_relative_to(folder.resolve()) and path.is_file(), src
        check_png(path)
    return page


# ---------------------------------------------------------------------- synthetic results


def _study_ds(klass: np.ndarray) -> xr.Dataset:
    status = np.where(klass == "", "pending", "ok")
    dims = ("task", "selector", "direction", "repeat")
    return xr.Dataset({"klass": (dims, klass), "status": (dims, status)},
                      coords={"task": ["T/1", "T/2"], "selector": ["EMPTY", "ALL", "EARLY"],
                              "direction": ["A->R", "R->A"], "repeat": [0, 1]})


def test_page_writes_valid_pngs_and_removes_stale_ones(tmp_path):
    rng = np.random.default_rng(0)
    klass = rng.choice(np.array(["B", "C", "D"]), size=(2, 3, 2, 2))
    klass[1, 2, 1, 1] = ""
    page = Page("a <title>", "intro & more", markdown="## Table\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n<script>x</script>\n")
    page.add("class matrix", figures.class_matrix(_study_ds(klass)), "caption <b>")
    page.add("forest", figures.forest([{"ratio": "X/Y", "qualified": True, "estimate": 1.2, "lower": 1.1,
                                        "upper": 1.3, "above_threshold": True},
                                       {"ratio": "Z/Y", "qualified": False, "note": "Z not qualified"}], 1.02),
             "forest")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "old.png").write_bytes(PNG_MAGIC)
    (tmp_path / "figures" / "notes.txt").write_text("kept")
    path = page.write(tmp_path)
    html = check_page(tmp_path, 2)
    assert path == tmp_path / "report.html"
    assert referenced_images(html) == ["figures/class-matrix.png", "figures/forest.png"]
    assert not (tmp_path / "figures" / "old.png").exists() and (tmp_path / "figures" / "notes.txt").exists()
    assert "<script>" not in html and "&lt;script&gt;" in html and "a &lt;title&gt;" in html
    assert "<table>" in html and "<td>1</td>" in html
    with pytest.raises(ValueError):
        page.add("bad", b"GIF89a", "not a png")


def test_figures_say_when_there_is_nothing_to_draw(tmp_path):
    for i, png in enumerate((figures.frontier_contrasts([{"task": "T", "t_star": -1}]), figures.forest([]),
                             figures.kv_profile({}))):
        (tmp_path / f"{i}.png").write_bytes(png)
        check_png(tmp_path / f"{i}.png")


def test_margin_trajectories_and_profile_from_datasets(tmp_path):
    from statelab.analysis.classes import kv_profile_dataset

    m = np.abs(np.random.default_rng(1).normal(2, 1, size=(2, 2, 12)))
    m[1, :, 8:] = np.nan
    ds = xr.Dataset({"margin": (("task", "arm", "output"), m), "first_diff": (("task",), [5, -1])},
                    coords={"task": ["T/1", "T/2"], "arm": ["A", "R"], "output": np.arange(12)})
    (tmp_path / "m.png").write_bytes(figures.margin_trajectories(ds))
    check_png(tmp_path / "m.png")
    recs = [{"layer": k, "component": c, "changed_bytes": 10 * k, "max_abs": 0.1 * k, "l2": 1.0, "l2_rel": 1e-3 * k}
            for k in range(4) for c in "KV"]
    prof = kv_profile_dataset(recs)
    assert dict(prof.sizes) == {"layer": 4, "component": 2}
    assert float(prof.max_abs.sel(layer=3, component="V")) == pytest.approx(0.3)
    (tmp_path / "p.png").write_bytes(figures.kv_profile({"pair": prof}))
    check_png(tmp_path / "p.png")


# ---------------------------------------------------------------------- real-model runs


def _tiny_study_spec(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text('name = "tiny-report"\nthreads = 1\ncap = 16\nrepeats = 1\nprompts = ["HumanEval/2"]\n'
                 'selectors = ["EARLY", "LATE"]\ndirections = ["A->R"]\n\n[arms]\nA = "A"\nR = "R"\n')
    return p


@pytest.mark.model
def test_study_run_and_report_write_report_html(tmp_path):
    out = tmp_path / "study"
    r = run_cli("study", "run", _tiny_study_spec(tmp_path), "--out", out, "--workers", "1", env=THREADS)
    assert r.returncode == 0, r.stderr
    assert str(out / "report.html") in r.stdout
    html = check_page(out, 2)
    assert referenced_images(html) == ["figures/class-matrix.png", "figures/kv-profile.png"]
    assert "<h2>Class matrix</h2>" in html and "HumanEval/2" in html
    first = (out / "figures" / "class-matrix.png").read_bytes()
    (out / "report.html").unlink()
    r = run_cli("study", "report", out, env=THREADS)
    assert r.returncode == 0, r.stderr
    check_page(out, 2)
    assert (out / "figures" / "class-matrix.png").read_bytes() == first  # same results, same figure
    one_line_error(run_cli("study", "report", tmp_path / "nowhere"), "not a study output folder")


@pytest.mark.model
def test_frontier_run_and_analyse_write_report_html(tmp_path):
    spec = tmp_path / "f.toml"
    spec.write_text('name = "f-report"\nthreads = 1\ncap = 8\nrepeats = 2\nprompts = ["HumanEval/86"]\n'
                    'directions = ["A->R"]\npanels = ["POSITION"]\n\n[arms]\nA = "A"\nR = "R"\n')
    out = tmp_path / "run"
    r = run_cli("frontier", "run", spec, "--out", out, env=THREADS)
    assert r.returncode == 0, r.stderr
    html = check_page(out, 2)
    srcs = referenced_images(html)
    assert srcs[0] == "figures/frontier-contrasts.png"
    assert any(s.startswith("plots/") for s in srcs)  # the score plot around t* of report.md
    (out / "report.html").unlink()
    r = run_cli("frontier", "analyse", out, env=THREADS)
    assert r.returncode == 0, r.stderr
    assert referenced_images(check_page(out, 2)) == srcs


@pytest.mark.model
def test_campaign_writes_a_forest_plot(tmp_path):
    from statelab.experiments.campaign import CampaignSpec, run_campaign
    from statelab.report import campaign_page

    spec = CampaignSpec(prompts=["HumanEval/2"], arms=["R", "M_QB"], sessions=2, cap=4, threads=1,
                        ratios=[["R", "M_QB"]], resamples=200)
    res = run_campaign(spec, tmp_path)
    page = campaign_page(tmp_path, res.outputs["contrasts"], spec.threshold)
    html = check_page(page.parent, 1)
    assert referenced_images(html) == ["figures/campaign-forest.png"]
    row = res.outputs["contrasts"][0]
    assert row["ratio"] == "R/M_QB" and row["qualified"]  # QB reproduces R on CPU
    assert "Request-time ratios" in html


@pytest.mark.model
def test_demo_and_diff_plot(tmp_path):
    from statelab.experiments import demo
    from statelab.report import demo_page

    class Seen(demo.DemoView):  # the demo shows nothing itself: what a caller's view hears
        tables: list = []
        lines: list = []

        def partition(self, rows, title):
            self.tables.append((title, rows))

        def say(self, text):
            self.lines.append(text)

    out, seen = tmp_path / "demo", Seen()
    res = demo.run(seen, None, "cpu", 8, ["HumanEval/86"], 1, out,
                   frontier_tasks=["HumanEval/86"], frontier_cap=4, matrix=False,
                   page=lambda folder, r: demo_page(folder, r.partition, r.matrix, r.frontier))
    rows = res.rows
    assert [t for t, _ in seen.tables] and seen.tables[0][1] == rows and "partition study on cpu" in seen.tables[0][0]
    assert any("HumanEval/86" in line for line in seen.lines)  # the frontier section's lines
    assert res.page == out / "report.html"
    assert demo.failed_controls(rows, out) == []
    assert demo.failed_controls([dict(rows[0], shams_ok=False)], out) == [
        f"{rows[0]['prompt']} {rows[0]['pair']}: sham differs from the natural endpoint"]
    html = check_page(out, 3)
    assert referenced_images(html) == ["figures/natural-margins.png", "figures/kv-profile.png",
                                       "figures/frontier-contrasts.png"]
    part = xr.load_dataset(out / "partition.nc")
    assert part.arm.values.tolist() == ["A", "R"]
    toks = part.token.sel(task="HumanEval/86").values
    fd = int(part.first_diff.sel(task="HumanEval/86"))
    assert 0 <= fd < 8 and (toks[0, :fd] == toks[1, :fd]).all() and toks[0, fd] != toks[1, fd]
    margins = part.margin.sel(task="HumanEval/86").values
    assert np.isfinite(margins).all() and (margins >= 0).all() and margins.shape == (2, 8)
    assert (part.l2_rel.sel(task="HumanEval/86") > 0).any()  # A and R form different states on CPU

    a, b = tmp_path / "a", tmp_path / "b"
    for path, s in ((a, "A"), (b, "R")):
        r = run_cli("capture", path, "-H", "86", "-s", s, "--threads", "1", env=THREADS)
        assert r.returncode == 0, r.stderr
    plot = tmp_path / "profile.png"
    r = run_cli("diff", a, b, "--plot", plot, env=THREADS)
    assert r.returncode == 0, r.stderr
    check_png(plot)
    one_line_error(run_cli("diff", a, b, "--plot", tmp_path / "profile.svg", env=THREADS), "ending in .png")
    one_line_error(run_cli("diff", a, b, "--plot", tmp_path / "no" / "p.png", env=THREADS), "does not exist")
