"""One process for a batch of study cells: ``python -m statelab.experiments.matrix.batch
[--lanes L]`` (the body is :mod:`statelab.experiments.lanes`: tasks on stdin, the model
loaded once, one ``STATELAB_UNIT <json>`` line per cell as it finishes).

The ``batch`` executor (:mod:`statelab.experiments.executors`) groups a study's cells by
(prompt, direction, repeat), or by repeat with lanes (:func:`cells.batch_key`); the repeats
of a coordinate always run in different processes (process repeats stay independent).
Within a batch the verified captures and selectors are read once, a cross whose inputs are
byte-identical to one already run is not run again (its record names the cell that ran,
``same_cross_as``), and each lane keeps one context per configuration, cleared before every
cell (``runtime.ContextPool``).
"""
from __future__ import annotations

import sys
from functools import partial

from statelab.experiments import lanes
from statelab.experiments.matrix.cells import failed_record, run_cell
from statelab.runtime import Model


def _load(task: dict) -> Model:  # one model per study
    return Model(task["model"], backend=task["backend"])


def _work(task, model, cache, contexts) -> dict:
    return run_cell(task, model=model, cache=cache, contexts=contexts)


run_tasks = partial(lanes.run_tasks, work=_work, failed=failed_record, load=_load)


if __name__ == "__main__":
    sys.exit(lanes.main("statelab.experiments.matrix.batch", sys.argv[1:], work=_work, failed=failed_record,
                        load=_load))
