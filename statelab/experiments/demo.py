"""`statelab demo`: the main job on the embedded default.

Partition study: on CPU the arms A (whole prompt, ubatch 512) and R (token by token);
on CUDA and Vulkan A, B and C.  Natural endpoints, own-path shams, whole-KV crosses both
ways, summarised as a table and written to a Markdown report.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from statelab import prompts as prompts_mod
from statelab.analysis.results import load_results
from statelab.experiments import engine
from statelab.experiments.frontier_panels import frontier_section as section
from statelab.experiments.matrix.runner import run_study
from statelab.experiments.matrix.spec import spec_from_data
from statelab.experiments.partition import PartitionSpec, run_partition
from statelab.lab.formation import differing_arms
from statelab.lab.receiver import check_cap
from statelab.errors import ConfigError
from statelab.paths import atomic_write_netcdf, atomic_write_text, output_lock
from statelab.runtime import ContextConfig, Model, prepare_backend
from statelab.runtime.native import backend_info


def default_tasks(backend: str) -> str:
    """Prompts whose natural endpoints differ between the backend's arms (``runtime.native.Backend``)."""
    return ",".join(backend_info(backend).tasks)


def default_matrix_tasks(backend: str) -> list[str]:
    """The selector matrix's prompts on the backend (``runtime.native.Backend.matrix_tasks``)."""
    return list(backend_info(backend).matrix_tasks)


SELECTOR_MATRIX = ["EMPTY", "ALL", "L0_K", "L0_V", "L0", "K_ALL", "V_ALL", "EARLY", "MIDDLE", "LATE", "PREFIX",
                   "TAIL"]


def matrix_spec_data(model_path, backend: str, arms: dict, tasks: list[str], cap: int, threads: int) -> dict:
    """The demo's selector-matrix study spec as data (what a study TOML file would hold):
    the first two arms, both directions, 2 repeats, the 12 selectors."""
    names = list(arms)[:2]
    data = {"name": f"demo-selector-matrix-{backend}", "backend": backend, "threads": threads, "cap": cap,
            "repeats": 2, "prompts": list(tasks), "selectors": list(SELECTOR_MATRIX),
            "directions": [f"{names[0]}->{names[1]}", f"{names[1]}->{names[0]}"],
            "arms": {n: arms[n].name for n in names}}
    if model_path is not None:
        data["model"] = str(Path(model_path).resolve())
    return data


class DemoView:
    """What the demo shows while it runs: nothing here; the command passes one that draws
    progress bars, the partition table and lines on the terminal."""

    def progress(self, label: str, transient: bool = False) -> engine.Progress:
        return engine.Progress()

    def partition(self, rows: list[dict], title: str) -> None:
        """The partition study's rows, once it ran (before the selector matrix starts)."""

    def say(self, text: str) -> None:
        """One line of what the demo did."""


def selector_matrix(view: DemoView, model_path, backend: str, arms: dict, tasks: list[str], cap: int, threads: int,
                    out: Path) -> tuple[str, list[str]]:
    """The 12-selector matrix in both directions with 2 repeats (a study run: fresh worker
    processes, resumable).  Returns the report section and the prompts where some subset
    cross reproduced the donor (class B): the inputs the frontier panels look at."""
    import xarray as xr


    workers = 2
    # ggml's threads spin-wait: never give the workers together more threads than there are cores
    threads = threads or max(1, (os.cpu_count() or workers) // workers)
    data = matrix_spec_data(model_path, backend, arms, tasks, cap, threads)
    spec = spec_from_data(data, Path(out).with_suffix(".toml"))  # stands for a spec file beside the folder
    summary = run_study(None, out, executor="local", workers=workers, reporter=view.progress("cells"), spec=spec)
    ds = xr.load_dataset(summary.results)
    effects = [str(t) for t in ds["task"].values if (ds["klass"].sel(task=t) == "B").any()]
    report = Path(summary.report).read_text()
    view.say(f"selector matrix: {summary.ran} cells run ({summary.skipped} resumed), report {summary.report}; "
                  f"donor effects (class B) on: {', '.join(effects) or 'none'}")
    return "## Selector matrix\n\n" + report.split("\n", 1)[1], effects


def arms_for(backend: str) -> dict:
    """The presets that form different states on the backend (``runtime.native.Backend.arms``)."""
    return differing_arms(backend)


def frontier_section(model, base, prompts, cap: int = 48, say=None, directions=None,
                     results_path: Path | None = None) -> str:
    """The L0 and POSITION frontier panels of ``prompts`` (Prompt objects or prompt specs) as a
    Markdown section: for the inputs where the selector matrix found donor effects.  Runs in
    this process (one repeat per direction, cap ~48) with the arms that differ on the backend;
    the contrasts' Dataset is also saved to ``results_path`` when given; ``say(line)`` hears
    each panel."""
    ps = [prompts_mod.resolve(p) if isinstance(p, str) else p for p in prompts]
    return section(model, base, ps, cap, arms=arms_for(base.backend), directions=directions, say=say or (lambda msg: None),
                   results_path=results_path)


@dataclass
class DemoResult:
    """What the demo measured: the partition rows and the datasets the HTML page draws."""
    rows: list[dict]
    partition: object  # xarray.Dataset or None
    matrix: object
    frontier: object
    report: Path
    page: Path | None = None  # what the caller's ``page(out, result)`` wrote (report.html)


def run(view: DemoView | None, model_path, backend: str, cap: int, tasks: list[str], threads: int, out: Path,
        frontier_tasks: list[str] | None = None, frontier_cap: int = 48, matrix: bool = True,
        matrix_tasks: list[str] | None = None, matrix_cap: int = 48, page=None) -> "DemoResult":
    """The demo into ``out``, as its one writer (a second demo on the same folder is refused);
    it returns its data and shows nothing itself (``view``: what the caller shows while it
    runs); the caller draws the HTML page from the returned data, under the same lock (``page``)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, ConfigError):
        res = _run(view or DemoView(), model_path, backend, cap, tasks, threads, out, frontier_tasks, frontier_cap, matrix,
                   matrix_tasks, matrix_cap)
        if page is not None:
            res.page = page(Path(out), res)
        return res


def _run(view: DemoView, model_path, backend: str, cap: int, tasks: list[str], threads: int, out: Path,
         frontier_tasks: list[str] | None, frontier_cap: int, matrix: bool, matrix_tasks: list[str] | None,
         matrix_cap: int):
    check_cap(cap)
    prepare_backend(backend)
    specs = [t.strip() for t in tasks if t.strip()]
    for t in specs:
        prompts_mod.resolve(t)  # every prompt checked before any run
    arms = arms_for(backend)
    t0 = time.perf_counter()
    study = run_partition(PartitionSpec(specs, "study", {n: a.name for n, a in arms.items()}, cap=cap,
                                        backend=backend, threads=threads, model=model_path),
                          Path(out) / "partition", view.progress(f"partition study ({', '.join(arms)})", transient=True))
    rows = study.outputs["rows"]
    view.partition(rows, f"partition study on {backend}: arms {', '.join(arms)}, cap {cap} "
                         f"({time.perf_counter() - t0:.0f} s)")
    model = Model(model_path, backend=backend)
    base = ContextConfig(backend=backend, n_threads=threads)
    report = (f"# statelab demo ({backend})\n\nmodel: {model.info.name} ({model.sha256[:16]})\n\n"
              f"## Partition study (arms {', '.join(arms)}, cap {cap})\n\n" + study.outputs["markdown"])
    out = Path(out)
    partition = study.outputs["dataset"]
    atomic_write_netcdf(out / "partition.nc", partition)
    matrix_ds = frontier_ds = None
    if matrix:
        section, effects = selector_matrix(view, model_path, backend, arms, matrix_tasks or default_matrix_tasks(backend),
                                           matrix_cap, threads, out / "selector-matrix")
        report += "\n" + section
        matrix_ds = load_results(out / "selector-matrix" / "results.nc")
        if frontier_tasks is None:
            frontier_tasks = effects
    if frontier_tasks:
        report += "\n" + frontier_section(model, base, frontier_tasks, frontier_cap, view.say,
                                          results_path=out / "frontier.nc")
        frontier_ds = load_results(out / "frontier.nc")
    atomic_write_text(out / "report.md", report)
    return DemoResult(rows, partition, matrix_ds, frontier_ds, out / "report.md")


def failed_controls(rows: list[dict], out: Path) -> list[str]:
    """The demo's controls that failed: partition-study shams, and selector-matrix cells withheld
    because a prompt's controls failed (empty: all passed)."""
    bad = [f"{r['prompt']} {r['pair']}: sham differs from the natural endpoint" for r in rows
           if r.get("shams_ok") is False]
    results = Path(out) / "selector-matrix" / "results.nc"
    if results.is_file():
        n = int((load_results(results).status.values == "withheld").sum())
        if n:
            bad.append(f"selector matrix: {n} cells withheld after failed controls")
    return bad
