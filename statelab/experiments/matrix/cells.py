"""Cells: one (prompt, selector, direction, repeat) subset cross.

:func:`plan` turns a study folder (spec + controls) into task dicts (plain JSON);
:func:`run_cell` executes one task: load the model and the archived captures (verified),
build the selection on the recipient's real state, run ``subset_cross`` in the recipient's
configuration and classify the endpoint against both natural endpoints.  The runner calls
it in a fresh process per cell (:data:`CELL`, through :mod:`statelab.experiments.executors`).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time

import numpy as np

from statelab.analysis.classes import endpoint_class, first_difference
from statelab.lab.formation import Capture
from statelab.errors import IdentityError
from statelab.experiments.executors import Unit
from statelab.experiments.lanes import CellCache
from statelab.experiments.naming import Direction
from statelab.lab.intervene import check_pair, config_of, subset_cross
from statelab.lab.receiver import Endpoint
from statelab.runtime import Model
from statelab.selection import select, subset_payload
from statelab.experiments.matrix.spec import StudyError, cell_key


def endpoint_sha256(tokens, eog: bool) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int32).tobytes() + bytes([bool(eog)])).hexdigest()


def plan(spec_record: dict, sdir, controls: dict[str, dict]) -> tuple[list[dict], dict[str, str]]:
    """All cell tasks of a study in spec order, and the withheld keys (key -> reason)."""
    norm = spec_record["normalized"]
    tasks, withheld = [], {}
    for p in norm["prompts"]:
        pid = p["id"]
        ctl = controls.get(pid)
        for sel in norm["selectors"]:
            for d in norm["directions"]:
                donor, recip = Direction.parse(d)
                for r in range(norm["repeats"]):
                    key = cell_key(pid, sel["name"], d, r)
                    if ctl is None:
                        withheld[key] = "controls were not run"
                        continue
                    if not ctl["passed"]:
                        withheld[key] = "; ".join(ctl["reasons"])
                        continue
                    tasks.append({
                        "key": key, "spec_hash": spec_record["spec_hash"], "prompt": pid, "selector": sel["name"],
                        "selector_source": spec_record["selector_sources"][sel["name"]],
                        "selector_terms": sel["terms"], "selector_dirs": spec_record["selector_dirs"],
                        "direction": d, "donor": donor, "recipient": recip, "repeat": r,
                        "donor_capture": str(sdir.capture_dir(pid, donor).resolve()),
                        "recipient_capture": str(sdir.capture_dir(pid, recip).resolve()),
                        "natural_donor": ctl["arms"][donor]["natural"],
                        "natural_recipient": ctl["arms"][recip]["natural"],
                        "cap": norm["cap"], "model": spec_record["model_path"], "backend": norm["backend"],
                        "model_sha256": norm["model_sha256"],
                    })
    return tasks, withheld


def failed_record(task: dict, error: str, **extra) -> dict:
    return {"key": task["key"], "spec_hash": task["spec_hash"], "prompt": task["prompt"],
            "selector": task["selector"], "direction": task["direction"], "repeat": task["repeat"],
            "status": "failed", "error": " ".join(str(error).split())[:2000], **extra}


def cross_identity(blob, recipient: Capture, recipient_hashes: dict, cap: int) -> str:
    """What a subset cross computes, by content: the state stream it imports (the recipient's
    bytes with the donor's selected values written in), the recipient's initial logits and
    context configuration, and the cap.  Two cells with the same identity run the same
    computation: B->A and C->A where B and C formed byte-identical states, and every selection
    of a cross whose donor formed the recipient's state byte for byte (each imports the
    recipient's own state, as EMPTY does), or whose selected values equal the recipient's."""
    parts = [hashlib.sha256(blob).hexdigest(), recipient_hashes["logits"],
             json.dumps(config_of(recipient).as_dict(), sort_keys=True), str(int(cap))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def run_cell(task: dict, model=None, cache: CellCache | None = None, contexts=None) -> dict:
    """Execute one cell; ``model`` may be passed to reuse a loaded model (tests, tools).

    In a batch process (:mod:`statelab.experiments.matrix.batch`) ``cache`` keeps the
    verified captures and selectors, and a cell whose cross has the identity
    (:func:`cross_identity`) of one already run in this process is not run again: its record
    is built from that cross's endpoint and account, classified against its own natural
    endpoints, with ``same_cross_as`` naming the cell that ran.  ``contexts`` (a
    ``runtime.ContextPool`` of the calling lane): the cross decodes in its cleared context.
    Raises on any failure (the worker turns it into a failed record)."""
    t0 = time.perf_counter()
    if model is None:
        model = Model(task["model"], backend=task["backend"])
    if model.sha256 != task["model_sha256"]:
        raise IdentityError(f"the worker's model {model.sha256[:12]} is not the study's {task['model_sha256'][:12]}")
    t_load = time.perf_counter()
    cache = CellCache() if cache is None else cache

    def cached(key, make):
        return cache.get(key, make)[0]

    donor, recipient = cache.capture(task["donor_capture"]), cache.capture(task["recipient_capture"])
    selector = cache.selector(task["selector_source"], task["selector_dirs"])
    if selector.describe() != task["selector_terms"]:
        raise StudyError(f"selector {task['selector']} changed since the study started: "
                         f"{selector.describe()!r} != {task['selector_terms']!r}")
    # every cell checks its own pair, also one whose cross another cell of this process ran
    check_pair(model, donor, recipient)
    sel = select(selector, recipient.state)
    hashes_d = cached(("hashes", task["donor_capture"]), donor.hashes)
    hashes_r = cached(("hashes", task["recipient_capture"]), recipient.hashes)
    t_ready = time.perf_counter()
    payload = subset_payload(recipient.state, donor.state, sel)  # what the cross imports, and its name
    identity = cross_identity(payload[0], recipient, hashes_r, task["cap"])
    t_mix = time.perf_counter()
    parts: dict = {}  # where the cross's time went (intervene.subset_cross), when it ran here
    (ep, acc, first_key), ran_here = cache.get(
        ("cross", identity), lambda: (*subset_cross(model, donor, recipient, sel, int(task["cap"]), contexts=contexts,
                                                    timing=parts, payload=payload), task["key"]))
    t_done = time.perf_counter()
    if ran_here:  # the mix (and its hash) was made here, before the cross
        parts["mix_s"] = t_mix - t_ready
    nat_d = Endpoint.from_dict(task["natural_donor"])
    nat_r = Endpoint.from_dict(task["natural_recipient"])
    rec = {
        "key": task["key"], "spec_hash": task["spec_hash"], "status": "ok",
        "prompt": task["prompt"], "selector": task["selector"], "direction": task["direction"],
        "donor": task["donor"], "recipient": task["recipient"], "repeat": task["repeat"],
        "klass": endpoint_class(ep, nat_d, nat_r),
        "first_diff_recipient": first_difference(ep.tokens, nat_r.tokens),
        "first_diff_donor": first_difference(ep.tokens, nat_d.tokens),
        "selected_bytes": int(sel.selected_bytes), "share": float(sel.share),
        "total_value_bytes": int(acc.total_value_bytes), "changed_bytes": int(acc.changed_bytes),
        "max_abs": float(acc.max_abs), "l2": float(acc.l2), "l2_rel": float(acc.l2_rel),
        "first_differing_layer": acc.first_differing_layer, "verified": bool(acc.verified),
        "endpoint": ep.as_dict(), "endpoint_sha256": endpoint_sha256(ep.tokens, ep.eog),
        "length": ep.length, "stop_reason": ep.stop_reason, "eog": bool(ep.eog),
        "donor_kv_sha256": hashes_d["kv"], "recipient_kv_sha256": hashes_r["kv"],
        "timing": {"load_s": t_load - t0, "prepare_s": t_ready - t_load,
                   "cross_s": t_done - t_ready if ran_here else 0.0, "cell_s": t_done - t0,
                   **({f"cross_{k}": v for k, v in parts.items()} if ran_here else {})},
        "pid": os.getpid(), "host": socket.gethostname(),
    }
    if not ran_here:  # the same computation ran for another cell of this process
        rec["same_cross_as"] = first_key
    return rec


def cell_record(task: dict) -> dict:
    """One cell's record in its fresh process; any failure becomes a failed record."""
    try:
        return run_cell(task)
    except Exception as e:  # reported as a failed cell, never silently dropped
        return failed_record(task, f"{type(e).__name__}: {e}")


def batch_key(task: dict, lanes: int = 1) -> tuple:
    """Cells of one batch process (the batch executor): the same prompt, direction and
    repeat; with lanes (several cells at once in one process: the shape for a GPU, one
    process holding the device) a whole repeat.  The repeats never share a process."""
    if lanes > 1:
        return (int(task["repeat"]),)
    return task["prompt"], task["direction"], int(task["repeat"])


# how the executors run a cell (alone, or in batches: statelab.experiments.matrix.batch)
CELL = Unit("statelab.experiments.matrix.cells:cell_record", failed_record,
            batch="statelab.experiments.matrix.batch", batch_key=batch_key)
