"""The minimal sufficient selection search (paper S5.1), written once: ``study minimal`` and
the findings follow-ups (:mod:`.findings_run`) call it in process, each candidate a real
subset cross of the donor into the recipient through the common receiver."""
from __future__ import annotations

from dataclasses import dataclass

from statelab.analysis.classes import MinimalSelection, endpoint_class, minimal_sufficient_selection
from statelab.lab.intervene import subset_cross
from statelab.selection import Selection, Selector, Term, select


def box_selector(name: str, layers, component: str, positions) -> Selector:
    """One box: ``layers`` x ``component`` (K, V or KV) x positions ``[lo, hi)``."""
    return Selector(name, (Term(component=component, layers=tuple(int(x) for x in layers),
                                positions=(int(positions[0]), int(positions[1]))),))


@dataclass
class MinimalSearch:
    result: MinimalSelection
    layers: list[int]  # the found layers (model layer numbers)
    selection: Selection  # the found box on the recipient's state
    trials: list[dict]  # every candidate: layers, positions, class, selected and changed bytes


def search_minimal(model, donor, recipient, natural_donor, natural_recipient, cap: int, layers, positions,
                   component: str = "KV", refine: bool = True, contexts=None, follow=None,
                   on_trial=None) -> MinimalSearch:
    """Search a small box inside ``layers`` x ``component`` x ``positions`` that still
    reproduces the donor's natural endpoint (class B), with
    :func:`statelab.analysis.classes.minimal_sufficient_selection` over indices into ``layers``.
    ``contexts``: decode in a ``runtime.ContextPool``'s cleared contexts; ``follow``: stop a
    candidate's decoding at the first output that leaves these tokens (the donor's: exact for
    the oracle's question); ``on_trial(trial)`` hears every candidate."""
    layers = [int(x) for x in layers]
    trials: list[dict] = []

    def evaluate(ls, pr) -> bool:
        sel = select(box_selector("candidate", [layers[i] for i in ls], component, pr), recipient.state)
        ep, acc = subset_cross(model, donor, recipient, sel, cap, contexts=contexts, follow=follow)
        k = endpoint_class(ep, natural_donor, natural_recipient)
        trials.append({"layers": [layers[i] for i in ls], "positions": list(pr), "klass": k,
                       "selected_bytes": sel.selected_bytes, "changed_bytes": acc.changed_bytes})
        if on_trial is not None:
            on_trial(trials[-1])
        return k == "B"

    res = minimal_sufficient_selection(evaluate, len(layers), tuple(positions), refine=refine)
    found = [layers[i] for i in res.layers]
    final = select(box_selector("minimal", found, component, res.positions), recipient.state)
    return MinimalSearch(res, found, final, trials)
