"""The experiment kinds the engine runs, each as its four steps plus the runner that
strings them together (claiming the folder, the kind's own preparation, executing the
pending units through :mod:`.executors`, compiling):

    load_spec(path)    the spec file -> a validated spec object (one error style: specfile)
    plan(...)          the spec (and the folder's controls or captures) -> task dicts with a key
    unit               how one task runs in a fresh process: :class:`.executors.Unit`
    compile(...)       the durable records -> results.nc and report.md (no model needed)
    run(...)           the kind's runner (what the CLI command calls)

The fork server imports every kind's unit module before it forks (:func:`unit_modules`).
The partition study runs in process (no fresh-process units) and is not listed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from statelab.experiments import campaign, frontier_panels, spec_run
from statelab.experiments.executors import Unit
from statelab.experiments.matrix import cells, results, runner, spec


@dataclass(frozen=True)
class Kind:
    name: str
    load_spec: Callable
    plan: Callable
    unit: Unit
    compile: Callable
    run: Callable


KINDS = {
    "matrix": Kind("matrix", spec.load_spec, cells.plan, cells.CELL, results.compile_study, runner.run_study),
    "frontier": Kind("frontier", frontier_panels.load_spec, frontier_panels.plan_units,
                     Unit(frontier_panels.UNIT_FN, frontier_panels.unit_failed), frontier_panels.compile_run,
                     frontier_panels.run_frontier),
    "campaign": Kind("campaign", campaign.CampaignSpec.load, campaign.plan, spec_run.BLOCK, campaign.compile_campaign,
                     campaign.run_campaign),
}


# units that are not a kind of their own: follow-up work over a finished study folder
FOLLOW_UPS = {"findings": "statelab.experiments.findings_run:run_job",
              "masks": "statelab.experiments.spec_run:block_result"}


def unit_modules() -> list[str]:
    """The modules of every kind's and follow-up's unit function (what a fork server preloads)."""
    fns = [k.unit.fn for k in KINDS.values()] + list(FOLLOW_UPS.values())
    return list(dict.fromkeys(fn.partition(":")[0] for fn in fns))
