"""Study specifications expanded into cells (prompt x selector x direction x repeat), each
run in a fresh worker process, appended durably to a JSON-lines log, resumable, compiled
into an xarray Dataset and a Markdown report (paper 6.2, S5.1, S5.2).

    spec      parse and validate ``studies/*.toml``; the normalised spec and its hash
    store     the output folder (spec.json, captures, controls, cells.jsonl)
    controls  per-prompt captures, natural endpoints, shams, EMPTY/ALL controls
    cells     cell tasks and the cell itself (subset cross + record), run in a fresh
              process by the engine's executors (statelab.experiments.executors)
    results   Dataset (results.nc) and report (report.md), without a model
    runner    the kind MATRIX for the engine (controls, then cells), run_study and minimal_selection
"""
from statelab.experiments.matrix.results import DETERMINISTIC, compile_dataset, compile_study, load_dataset
from statelab.experiments.matrix.runner import MATRIX, default_out, minimal_selection, run_study
from statelab.experiments.matrix.spec import Direction, StudyError, StudySpec, cell_key, load_spec
from statelab.experiments.log import CellLog
from statelab.experiments.matrix.store import StudyDir

__all__ = ["DETERMINISTIC", "MATRIX", "CellLog", "Direction", "StudyDir", "StudyError", "StudySpec",
           "cell_key", "compile_dataset", "compile_study", "default_out", "load_dataset", "load_spec",
           "minimal_selection", "run_study"]
