"""Reports people look at: ``report.html`` with matplotlib figures beside the Markdown
reports of ``statelab demo``, ``study run|report``, ``frontier run|analyse`` and
``spec campaign``, and the per-layer K/V profile of ``statelab diff --plot FILE``.

Figures are PNG files in ``figures/`` beside ``report.html`` (relative ``<img src>``), so a
folder can be copied or served as it is and every image is a file a test can check."""
from __future__ import annotations

from pathlib import Path

import xarray as xr

from statelab.analysis.classes import kv_profile_dataset
from statelab.analysis.frontier import frontier_rows
from statelab.analysis.results import load_results
from statelab.errors import StatelabError
from statelab.kvstate import compare
from statelab.report import figures
from statelab.report.page import FIGURES, PNG_MAGIC, Page, markdown_html, referenced_images, write_file

__all__ = ["ReportError", "Page", "FIGURES", "PNG_MAGIC", "markdown_html", "referenced_images", "figures",
           "study_page", "frontier_page", "campaign_page", "demo_page", "diff_plot", "capture_profiles"]


class ReportError(StatelabError):
    """A report cannot be built from the folder (missing or foreign results)."""


def _read_md(folder: Path) -> str:
    p = folder / "report.md"
    return p.read_text(encoding="utf-8", errors="replace") if p.is_file() else ""


def capture_profiles(pairs: dict[str, tuple]) -> dict[str, xr.Dataset]:
    """label -> (capture a, capture b) to label -> per-layer K/V difference Dataset."""
    return {label: kv_profile_dataset(compare(a.state, b.state).records()) for label, (a, b) in pairs.items()}


def _results(out: Path, ds: xr.Dataset | None, load, command: str) -> xr.Dataset:
    if ds is not None:
        return ds
    if not (out / "results.nc").is_file():
        raise ReportError(f"{out}: no results.nc (run `statelab {command} {out}` first)")
    return load(out / "results.nc")


def _add_profiles(page: Page, profiles: dict[str, xr.Dataset]) -> None:
    if profiles:
        page.add("kv-profile", figures.kv_profile(profiles, "natural states: per-layer K/V differences"),
                 "Per-layer K/V difference of the natural states of the first two arms, per prompt "
                 "(solid K, dashed V).")


def study_page(out, ds: xr.Dataset | None = None, markdown: str | None = None, pairs: dict | None = None) -> Path:
    """OUT/report.html of a study folder: class-matrix heatmap, the per-layer K/V profile
    of the natural arms' captures (``pairs``: label -> (capture, capture), as
    ``experiments.matrix.store.StudyDir.natural_pairs`` reads them), then report.md."""
    out = Path(out)
    ds = _results(out, ds, load_results, "study report")
    page = Page(f"Study {ds.attrs.get('study', out.name)}",
                f"backend {ds.attrs.get('backend', '?')}, cap {ds.attrs.get('cap', '?')}, model "
                f"{str(ds.attrs.get('model_sha256', ''))[:16]}, spec {str(ds.attrs.get('spec_hash', ''))[:16]}",
                markdown=_read_md(out) if markdown is None else markdown)
    page.add("class-matrix", figures.class_matrix(ds),
             "Endpoint class of every subset cross: rows are selectors, columns prompt x direction x repeat "
             "(B reproduces the donor, C a third trajectory, D keeps the recipient; w/f/p: withheld, failed, pending).")
    _add_profiles(page, capture_profiles(pairs or {}))
    return page.write(out)


def _components(ds: xr.Dataset) -> dict:
    """panel -> (C1, C2) selector names of a frontier Dataset (its component list is EMPTY, C1, C2, BOTH)."""
    return {str(p): tuple(str(c) for c in ds["component"].sel(panel=p).values[1:3]) for p in ds["panel"].values}


def frontier_page(out, ds: xr.Dataset | None = None) -> Path:
    """OUT/report.html of a frontier run folder: the contrasts at every t*, then report.md
    (whose score plots in plots/ it shows in place)."""
    out = Path(out)
    ds = _results(out, ds, load_results, "frontier analyse")
    page = Page(f"Frontier panels: {ds.attrs.get('spec_name', out.name)}",
                f"backend {ds.attrs.get('backend', '?')}, cap {ds.attrs.get('cap', '?')}, "
                f"{ds.attrs.get('repeats', '?')} process repeats, model {str(ds.attrs.get('model_sha256', ''))[:16]}",
                markdown=_read_md(out))
    page.add("frontier-contrasts", figures.frontier_contrasts(frontier_rows(ds), _components(ds)),
             "Fixed-pair scores at t* of the four arms of every panel repeat with a frontier, with the additive "
             "prediction s(C1) + s(C2) - s(EMPTY); the grey bar is the interaction I = s(BOTH) - additive.")
    return page.write(out)


def campaign_page(out, rows: list[dict], threshold: float | None = None) -> Path:
    """OUT/report.html of a speculative campaign: forest plot of the ratios, then report.md."""
    out = Path(out)
    page = Page("Speculative campaign", f"{sum(1 for r in rows if r.get('qualified'))} of {len(rows)} ratios compared "
                "(both arms qualified against R)", markdown=_read_md(out))
    page.add("campaign-forest", figures.forest(rows, threshold),
             "Request-time ratios of qualified arms with 95% percentile-bootstrap intervals over sessions "
             "(blue: lower bound above the threshold).")
    return page.write(out)


def demo_page(out, partition: xr.Dataset | None, matrix: xr.Dataset | None, frontier: xr.Dataset | None) -> Path:
    """OUT/report.html of ``statelab demo``: natural trajectories' margins, the per-layer K/V
    profile of each prompt's arms, the selector-matrix heatmap, frontier contrasts, report.md."""
    out = Path(out)
    page = Page("statelab demo", markdown=_read_md(out))
    if partition is not None:
        page.intro = f"backend {partition.attrs.get('backend', '?')}, cap {partition.attrs.get('cap', '?')}"
        page.add("natural-margins", figures.margin_trajectories(partition),
                 "Natural arms: top-1 margin (greedy logit minus runner-up) at each output index along each arm's "
                 "own trajectory; the dotted line is the first output where the arms' tokens differ.")
        profiles = {f"{t} {partition.attrs.get('pair', '')}": partition.sel(task=t)[["changed_bytes", "max_abs",
                                                                                     "l2", "l2_rel"]]
                    for t in partition.task.values}
        _add_profiles(page, profiles)
    if matrix is not None:
        page.add("class-matrix", figures.class_matrix(matrix, title="selector matrix: endpoint classes"),
                 "Selector matrix: class of every subset cross (rows selectors, columns prompt x direction x repeat).")
    if frontier is not None:
        page.add("frontier-contrasts", figures.frontier_contrasts(frontier_rows(frontier), _components(frontier)),
                 "Frontier panels: scores at t* of EMPTY, C1, C2, BOTH and the additive prediction.")
    return page.write(out)


def diff_plot(a, b, diff_records: list[dict], path) -> Path:
    """``statelab diff --plot FILE``: the per-layer K/V profile of two captures as a PNG."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ReportError(f"--plot writes a PNG: give a file name ending in .png, got {path}")
    if not path.parent.is_dir():
        raise ReportError(f"--plot: folder {path.parent} does not exist")
    png = figures.kv_profile({f"{a.schedule.name} vs {b.schedule.name}": kv_profile_dataset(diff_records)},
                             f"{a.prompt_id}: per-layer K/V differences, {a.schedule.name} vs {b.schedule.name}")
    return write_file(path, png)
