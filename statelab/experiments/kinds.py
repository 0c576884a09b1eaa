"""Every experiment kind the engine runs (:func:`statelab.experiments.engine.run`), each a
short :class:`~statelab.experiments.engine.Kind` declared beside its steps:

    matrix     selector-matrix studies (``study run``)            experiments/matrix/runner.py
    frontier   frontier panels with full logit traces (``frontier run``)  experiments/frontier_panels.py
    campaign   speculative campaigns (``spec campaign``)         experiments/campaign.py
    findings   minimal selections / panels of a finished study's class-B cells
               (``study findings-run``)                           experiments/findings_run.py
    partition  partition studies and sweeps, one prompt a unit (``sweep``, the demo's study)
                                                                  experiments/partition.py
    masks      the phase-mask experiment (``spec masks``)           experiments/masks.py

A new kind: its module (spec, plan, unit, accept, compile and the ``Kind`` declaration) and
one line here.  The fork server imports every kind's unit module before it forks
(:func:`unit_modules`).  Run in process, outside the engine (no run folder, no durable log):
``spec run`` (its request block is the unit of the campaign and the phase masks).
"""
from __future__ import annotations

from statelab.experiments.campaign import CAMPAIGN
from statelab.experiments.engine import Kind
from statelab.experiments.findings_run import FINDINGS
from statelab.experiments.frontier_panels import FRONTIER
from statelab.experiments.masks import MASKS
from statelab.experiments.matrix.runner import MATRIX
from statelab.experiments.partition import PARTITION

KINDS: dict[str, Kind] = {k.name: k for k in (MATRIX, FRONTIER, CAMPAIGN, FINDINGS, PARTITION, MASKS)}


def unit_modules() -> list[str]:
    """The modules of every kind's unit function (what a fork server preloads)."""
    return list(dict.fromkeys(k.unit_module for k in KINDS.values()))
