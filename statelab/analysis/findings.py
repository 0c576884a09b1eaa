"""The paper's findings as tables with their denominators, over one or more study folders
(paper 6.2, S5.1-S5.3).  No model: everything comes from each folder's spec.json,
controls, results.nc, archived captures (byte masks, read verified) and the
``findings/minimal.jsonl`` / ``findings/panels.jsonl`` logs of :mod:`statelab.experiments.findings_run`.

Tables (each states what it counts and out of what):

1. natural divergence per arm pair: inputs whose natural endpoints differ / inputs;
2. endpoint agreement without state equality: inputs with unequal KV states whose natural
   endpoints agree / inputs with unequal states (and the converse, which must be 0);
3. magnitude separability per arm pair over the inputs with unequal states: max |d|, L2 rel
   and first differing layer of the natural states against diverging / stable, the best
   single threshold (either orientation) and its error rate; undecided without both labels;
4. non-monotone sufficiency: (smaller, larger) selections on the inclusion lattice of the
   actual byte masks where the smaller reproduces the donor (B, all repeats) and the larger
   does not; each with the selected-value counts and mask hashes that prove inclusion
   (values of the smaller outside the larger: 0);
5. minimal sufficient selections of class-B cells: sizes (layers, positions, bytes, share);
6. frontier panels of class-B cells: t*, interaction I, the top-1 margin condition, share
   of panels with nonzero interaction.
"""
from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx
import numpy as np
import xarray as xr

from statelab.analysis.classes import endpoint_key, selector_lattice
from statelab.errors import ConfigError
from statelab.experiments.matrix.results import _lattice_masks, load_dataset, load_state
from statelab.experiments.matrix.store import CellLog, StudyDir
from statelab.paths import atomic_path, atomic_write_text, output_lock
from statelab.report import figures as fig
from statelab.report.page import write_file
from statelab.selection import flat_mask_sha256

MAGNITUDES = (("max_abs", "max abs d"), ("l2_rel", "L2 rel"), ("first_differing_layer", "first differing layer"))


class FindingsInputError(ConfigError):
    """A folder the findings cannot be computed from, stated in one line."""


@dataclass
class RunData:
    root: Path
    name: str
    spec: dict
    controls: dict
    ds: xr.Dataset
    records: list
    minimal: list = field(default_factory=list)
    panels: list = field(default_factory=list)

    @property
    def arms(self) -> list[str]:
        return list(self.spec["normalized"]["arms"])

    @property
    def backend(self) -> str:
        return str(self.spec["normalized"]["backend"])


def _log(path: Path, spec_hash: str) -> list[dict]:
    if not path.is_file():
        return []
    out: dict[str, dict] = {}
    for r in CellLog(path).records():
        if r.get("spec_hash") == spec_hash:
            out[r["key"]] = r  # the latest record of a target wins (a failed one retried)
    return list(out.values())


def load_run(out) -> RunData:
    """A study folder with compiled results (``results.nc`` from this ``spec.json``)."""
    root = Path(out)
    if not (root / "spec.json").is_file():
        raise FindingsInputError(f"{root}: not a study folder (no spec.json)")
    sdir, spec, controls, records, _ok = load_state(root)
    if not sdir.results_path.is_file():
        raise FindingsInputError(f"{root}: no results.nc; run `statelab study report {root}` first")
    ds = load_dataset(sdir.results_path)
    if ds.attrs.get("spec_hash") != spec["spec_hash"]:
        raise FindingsInputError(f"{root}: results.nc was compiled from another spec; run `statelab study report`")
    return RunData(root, spec["normalized"]["name"], spec, controls, ds,
                   [r for r in records if r.get("spec_hash") == spec["spec_hash"]],
                   _log(root / "findings" / "minimal.jsonl", spec["spec_hash"]),
                   _log(root / "findings" / "panels.jsonl", spec["spec_hash"]))


# ---------------------------------------------------------------------- 1 and 2: natural pairs


def natural_pairs(run: RunData) -> list[dict]:
    """One row per (input, arm pair): natural endpoints equal?, KV states equal?"""
    rows = []
    for p in run.spec["normalized"]["prompts"]:
        c = run.controls.get(p["id"])
        if c is None:
            continue
        arms = c["arms"]
        for a, b in itertools.combinations(run.arms, 2):
            if a not in arms or b not in arms:
                continue
            rows.append({"run": run.name, "task": p["id"], "pair": f"{a}/{b}",
                         "endpoint_same": endpoint_key(arms[a]["natural"]) == endpoint_key(arms[b]["natural"]),
                         "state_same": arms[a]["kv"] == arms[b]["kv"], "n_prompt": c.get("n_prompt")})
    return rows


def _by_run_pair(rows: list[dict]):
    """(run, pair) -> its rows, in sorted order."""
    key = lambda r: (r["run"], r["pair"])  # noqa: E731
    return [(k, list(g)) for k, g in itertools.groupby(sorted(rows, key=key), key=key)]


def divergence_table(rows: list[dict]) -> list[dict]:
    """Per (run, pair): inputs, diverging, share; equal/unequal states and agreement."""
    out = []
    for (run, pair), g in _by_run_pair(rows):
        same = np.array([r["endpoint_same"] for r in g])
        state = np.array([r["state_same"] for r in g])
        out.append({"run": run, "pair": pair, "inputs": len(g), "diverging": int((~same).sum()),
                    "unequal_states": int((~state).sum()),
                    "agree_unequal_states": int((same & ~state).sum()),
                    "diverge_equal_states": int((~same & state).sum()),
                    "equal_states": int(state.sum())})
    return out


# ---------------------------------------------------------------------- 3: separability


def best_threshold(values, diverges) -> dict:
    """The single threshold on ``values`` that best separates diverging (True) from stable
    inputs, over both orientations ("diverging above": diverges iff value > t; "diverging
    below": diverges iff value < t).  Exhaustive over every cut between sorted values,
    vectorised.  Returns errors, error rate, orientation and threshold (midpoint of the cut)."""
    x = np.asarray(values, dtype=np.float64)
    y = np.asarray(diverges, dtype=bool)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise FindingsInputError("need equal-length, non-empty 1-D values and labels")
    if not np.all(np.isfinite(x)):
        raise FindingsInputError("values must be finite")
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order]
    # cut k (0..n) puts xs[:k] below and xs[k:] above; only cuts between distinct values are real
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(xs) > 0) + 1, [xs.size]])
    div_below = np.concatenate([[0], np.cumsum(ys)])[cuts]
    stable_below = cuts - div_below
    n_div, n_stable = int(ys.sum()), int((~ys).sum())
    err_above = div_below + (n_stable - stable_below)  # diverging below the cut + stable above it
    err_below = stable_below + (n_div - div_below)
    best = []
    for name, err in (("diverging_above", err_above), ("diverging_below", err_below)):
        i = int(np.argmin(err))
        k = int(cuts[i])
        thr = (-np.inf if k == 0 else np.inf if k == xs.size else float((xs[k - 1] + xs[k]) / 2))
        best.append((int(err[i]), name, thr))
    errors, orientation, thr = min(best, key=lambda b: (b[0], b[1]))
    return {"n": int(x.size), "diverging": n_div, "stable": n_stable, "errors": errors,
            "errors_increasing": best[0][0],  # the paper's rule (S5.2): diverges iff value > t
            "error_rate": errors / x.size, "orientation": orientation, "threshold": thr,
            "separable": errors == 0, "both_labels": bool(n_div and n_stable)}


def separability_rows(run: RunData) -> list[dict]:
    """Per input and reference arm pair of the controls: magnitudes and label (unequal states only)."""
    rows = []
    for p in run.spec["normalized"]["prompts"]:
        c = run.controls.get(p["id"])
        if c is None:
            continue
        for key, q in c.get("arm_pairs", {}).items():
            if q["kv_identical"]:
                continue
            rows.append({"run": run.name, "task": p["id"], "pair": key, "diverges": not q["natural_same"],
                         "max_abs": float(q["max_abs"]), "l2_rel": float(q["l2_rel"]),
                         "first_differing_layer": float(q["first_differing_layer"]),
                         "natural_first_diff": q["natural_first_diff"]})
    return rows


def separability_table(rows: list[dict]) -> list[dict]:
    out = []
    for (run, pair), g in _by_run_pair(rows):
        y = [r["diverges"] for r in g]
        for var, label in MAGNITUDES:
            res = best_threshold([r[var] for r in g], y)
            verdict = ("undecided (one label only)" if not res["both_labels"]
                       else "separable" if res["separable"] else "not separable")
            out.append({"run": run, "pair": pair, "magnitude": label, **res, "verdict": verdict})
    return out


# ---------------------------------------------------------------------- 4: non-monotone pairs


def agreed_classes(ds: xr.Dataset) -> xr.DataArray:
    """The class of each (task, selector, direction) whose repeats all agree, else ''."""
    k = ds["klass"].transpose("task", "selector", "direction", "repeat")
    v = k.values.astype(str)
    agree = np.all(v == v[..., :1], axis=-1) & (v[..., 0] != "")
    return xr.DataArray(np.where(agree, v[..., 0], ""), dims=("task", "selector", "direction"),
                        coords={d: k[d] for d in ("task", "selector", "direction")})


def non_monotone_in(masks: dict, outcomes: dict) -> tuple[list[dict], int]:
    """Non-monotone pairs on the lattice of ``masks`` given ``outcomes`` (name -> class), each
    with its inclusion proof, and the denominator: (B selection, strict superset with an
    outcome) pairs examined."""
    lat = selector_lattice(masks)
    pairs, examined = [], 0
    for small in lat.nodes:
        if outcomes.get(small) != "B":
            continue
        for large in nx.descendants(lat, small):
            if large not in outcomes:
                continue
            examined += 1
            if outcomes[large] == "B":
                continue
            a, b = np.asarray(masks[small]).ravel(), np.asarray(masks[large]).ravel()
            pairs.append({"small": small, "large": large, "large_class": outcomes[large],
                          "small_values": int(a.sum()), "large_values": int(b.sum()),
                          "small_outside_large": int((a & ~b).sum()),
                          "small_mask_sha256": flat_mask_sha256(a), "large_mask_sha256": flat_mask_sha256(b)})
    return sorted(pairs, key=lambda p: (p["small"], p["large"])), examined


def non_monotone(run: RunData, masks_for=None) -> tuple[list[dict], list[dict]]:
    """All non-monotone pairs of a run (repeat-agreeing classes; byte masks on each task's
    recipient state) and one denominator row per (task, direction)."""
    agreed = agreed_classes(run.ds)
    sdir = StudyDir(run.root)
    pairs, denominators = [], []
    for t in agreed.task.values:
        t = str(t)
        ctl = run.controls.get(t)
        if ctl is None or not ctl.get("passed"):
            continue
        masks = masks_for(t) if masks_for else _lattice_masks(sdir, run.spec, t, run.controls)
        names = [str(s) for s in agreed.selector.values]
        for d in agreed.direction.values:
            d = str(d)
            outcomes = {s: str(agreed.sel(task=t, selector=s, direction=d).item()) for s in names}
            outcomes = {s: k for s, k in outcomes.items() if k}
            if not outcomes:  # no repeat-agreeing result yet (pending or withheld): not a coordinate
                continue
            found, examined = non_monotone_in({s: masks[s] for s in names}, outcomes)
            pairs += [{"run": run.name, "task": t, "direction": d, **p} for p in found]
            denominators.append({"run": run.name, "task": t, "direction": d, "b_selections":
                                 sum(1 for k in outcomes.values() if k == "B"), "examined": examined,
                                 "non_monotone": len(found)})
    return pairs, denominators


# ---------------------------------------------------------------------- 5 and 6: minimal, panels


def class_b_count(run: RunData) -> int:
    return int((agreed_classes(run.ds).values == "B").sum())


def minimal_summary(runs: list[RunData]) -> dict:
    recs = [r for run in runs for r in run.minimal]
    ok = [r for r in recs if r.get("status") == "ok" and r.get("found")]
    b = sum(class_b_count(run) for run in runs)
    sizes = np.array([r["n_layers"] for r in ok]) if ok else np.zeros(0, int)
    return {"class_b_cells": b, "searched": sum(1 for r in recs if r.get("status") == "ok"), "found": len(ok),
            "skipped": sum(1 for r in recs if r.get("status") == "skipped"),
            "failed": sum(1 for r in recs if r.get("status") == "failed"),
            "layers_hist": dict(sorted(Counter(int(x) for x in sizes).items())),
            "single_position": sum(1 for r in ok if r["n_positions"] == 1),
            "median_bytes": float(np.median([r["selected_bytes"] for r in ok])) if ok else None,
            "median_share": float(np.median([r["share"] for r in ok])) if ok else None,
            "median_evaluations": float(np.median([r["evaluations"] for r in ok])) if ok else None}


def panel_summary(runs: list[RunData], tol: float = 0.0) -> dict:
    recs = [r for run in runs for r in run.panels]
    ok = [r for r in recs if r.get("status") == "ok"]
    with_f = [r for r in ok if r.get("t_star", -1) >= 0 and "interaction" in r]
    inter = np.array([r["interaction"] for r in with_f])
    return {"class_b_cells": sum(class_b_count(run) for run in runs), "panels": len(ok),
            "skipped": sum(1 for r in recs if r.get("status") == "skipped"),
            "failed": sum(1 for r in recs if r.get("status") == "failed"),
            "with_frontier": len(with_f),
            "nonzero_interaction": int((np.abs(inter) > tol).sum()),
            "top1_condition": sum(1 for r in with_f if r.get("top1")),
            "median_abs_interaction": float(np.median(np.abs(inter))) if inter.size else None,
            "median_t_star": float(np.median([r["t_star"] for r in with_f])) if with_f else None}


# ---------------------------------------------------------------------- Markdown


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "inf" if v == np.inf else "-inf" if v == -np.inf else f"{v:.4g}"
    return "" if v is None else str(v)


def md_table(cols: list[tuple[str, str]], rows: list[dict]) -> str:
    if not rows:
        return "(none)\n"
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _share(n: int, d: int) -> str:
    return f"{n} / {d}" + (f" ({100.0 * n / d:.1f} %)" if d else "")


@dataclass
class Findings:
    runs: list
    divergence: list
    natural: list
    separability: list
    separability_inputs: list
    nonmono_pairs: list
    nonmono_denominators: list
    minimal: dict
    panels: dict
    same_cross_cells: int = 0

    def as_dict(self) -> dict:
        return {"runs": [{"name": r.name, "folder": str(r.root), "spec_hash": r.spec["spec_hash"],
                          "backend": r.backend, "arms": r.arms} for r in self.runs],
                "divergence": self.divergence, "natural": self.natural, "separability": self.separability,
                "separability_inputs": self.separability_inputs, "non_monotone_pairs": self.nonmono_pairs,
                "non_monotone_denominators": self.nonmono_denominators, "minimal": self.minimal,
                "panels": self.panels, "same_cross_cells": self.same_cross_cells}


def compute(runs: list[RunData]) -> Findings:
    natural = [r for run in runs for r in natural_pairs(run)]
    sep_in = [r for run in runs for r in separability_rows(run)]
    pairs, dens = [], []
    for run in runs:
        p, d = non_monotone(run)
        pairs += p
        dens += d
    # same_mask_as: the field's name in run folders of an earlier statelab
    same = sum(1 for run in runs for r in run.records
               if (r.get("same_cross_as") or r.get("same_mask_as")) and r.get("status") == "ok")
    return Findings(runs, divergence_table(natural), natural, separability_table(sep_in), sep_in, pairs, dens,
                    minimal_summary(runs), panel_summary(runs), same)


def markdown(f: Findings) -> str:
    out = ["# Findings tables", ""]
    for run in f.runs:
        n = run.spec["normalized"]
        st = run.ds.status.values
        out.append(f"- `{run.name}` ({run.backend}, arms {', '.join(run.arms)}, cap {n['cap']}, "
                   f"{len(n['prompts'])} prompts x {len(n['selectors'])} selectors x {len(n['directions'])} "
                   f"directions x {n['repeats']} repeats = {st.size} cells; {int((st == 'ok').sum())} done, "
                   f"{int((st == 'withheld').sum())} withheld, {int((st == 'failed').sum())} failed, "
                   f"{int((st == 'pending').sum())} pending; spec {run.spec['spec_hash'][:12]})")
    out.append(f"\nCells whose cross had byte-identical inputs to one already run in the same process (the same "
               f"selection mask on the same states, logits and recipient configuration) were run once and recorded "
               f"under every name: {f.same_cross_cells} cells.\n")
    out.append("## 1. Natural endpoints per arm pair\n")
    out.append("Inputs whose natural endpoints (greedy, within the cap) differ, out of all inputs with controls.\n")
    out.append(md_table([("run", "run"), ("pair", "arm pair"), ("inputs", "inputs"), ("diverging", "diverging"),
                         ("share", "share")],
                        [{**r, "share": _share(r["diverging"], r["inputs"])} for r in f.divergence]))
    out.append("\n## 2. Endpoint agreement without state equality\n")
    out.append("Among inputs whose two natural KV states differ (sha256 of the K/V payload), how many still "
               "reach the same natural endpoint; and inputs with equal states whose endpoints differ (must be 0).\n")
    out.append(md_table([("run", "run"), ("pair", "arm pair"), ("unequal_states", "unequal states"),
                         ("agree", "same endpoint despite unequal states"), ("equal_states", "equal states"),
                         ("diverge_equal_states", "diverging with equal states")],
                        [{**r, "agree": _share(r["agree_unequal_states"], r["unequal_states"])}
                         for r in f.divergence]))
    out.append("\n## 3. Magnitude separability\n")
    out.append("Over the inputs whose natural states differ: does one threshold on the magnitude of the natural "
               "state difference (relative to the reference arm's state) separate diverging from stable inputs? "
               "Best single threshold over both orientations and every cut; its errors out of all inputs; and the "
               "errors of the best increasing rule alone (diverges iff magnitude > t, the rule of paper S5.2).\n")
    out.append(md_table([("run", "run"), ("pair", "pair"), ("magnitude", "magnitude"), ("n", "inputs"),
                         ("diverging", "diverging"), ("stable", "stable"), ("orientation", "best rule"),
                         ("threshold", "threshold"), ("err", "errors"), ("inc", "errors of the best increasing rule"),
                         ("verdict", "verdict")],
                        [{**r, "err": _share(r["errors"], r["n"]), "inc": _share(r["errors_increasing"], r["n"])}
                         for r in f.separability]))
    out.append("\n## 4. Non-monotone sufficiency\n")
    tot_ex = sum(d["examined"] for d in f.nonmono_denominators)
    coords = sum(1 for d in f.nonmono_denominators if d["non_monotone"])
    distinct = len({(p["run"], p["task"], p["direction"], p["small_mask_sha256"], p["large_mask_sha256"])
                    for p in f.nonmono_pairs})
    out.append(f"Pairs (smaller, strict superset) on the inclusion lattice of the actual byte masks, where the "
               f"smaller selection reproduces the donor (B in every repeat) and the superset does not (C or D in "
               f"every repeat). Found {_share(len(f.nonmono_pairs), tot_ex)} of the (B selection, superset) pairs "
               f"examined, at {coords} of {len(f.nonmono_denominators)} (task, direction) coordinates with results; "
               f"{distinct} of them are distinct (smaller mask, larger mask) pairs (selectors with identical masks, "
               f"e.g. PREFIX_V and V_ALL on a prompt of at most 128 tokens, count once there). Proof of "
               "inclusion per pair: the smaller mask's values outside the larger one (0) and both masks' sha256 "
               "(packed bits over the recipient state's K then V arrays) in `findings.json`.\n")
    by_cls = Counter(p["large_class"] for p in f.nonmono_pairs)
    if f.nonmono_pairs:
        out.append(f"Superset classes: {', '.join(f'{k} {v}' for k, v in sorted(by_cls.items()))}.\n")
        kinds = Counter((p["small"], p["large"]) for p in f.nonmono_pairs)
        top = [{"small": s, "large": lg, "n": n} for (s, lg), n in kinds.most_common(15)]
        out.append("Most frequent pairs (over tasks and directions):\n")
        out.append(md_table([("small", "sufficient (B)"), ("large", "superset (not B)"), ("n", "coordinates")], top))
        out.append("\nExamples with their proof (first per task):\n")
        seen, ex = set(), []
        for p in f.nonmono_pairs:
            if (p["run"], p["task"]) not in seen:
                seen.add((p["run"], p["task"]))
                ex.append({**p, "small_sha": p["small_mask_sha256"][:12], "large_sha": p["large_mask_sha256"][:12]})
        out.append(md_table([("run", "run"), ("task", "task"), ("direction", "direction"), ("small", "small (B)"),
                             ("large", "large"), ("large_class", "class"), ("small_values", "small values"),
                             ("large_values", "large values"), ("small_outside_large", "small outside large"),
                             ("small_sha", "small mask sha256"), ("large_sha", "large mask sha256")], ex))
    m = f.minimal
    out.append("\n## 5. Minimal sufficient selections of class-B cells\n")
    out.append(f"Class-B cells (B in every repeat): {m['class_b_cells']}. Searched (inside each cell's own box: its "
               f"layers, component and positions; one process repeat): {_share(m['searched'], m['class_b_cells'])}; "
               f"a sufficient selection found: {m['found']}; skipped {m['skipped']}, failed {m['failed']}.\n")
    if m["found"]:
        out.append(f"Layers in the minimal selection: "
                   f"{', '.join(f'{k}: {v}' for k, v in m['layers_hist'].items())} (layers: searches). "
                   f"A single position suffices in {_share(m['single_position'], m['found'])}. Median "
                   f"{m['median_bytes']:.0f} bytes ({100 * m['median_share']:.3g} % of the K/V values), median "
                   f"{m['median_evaluations']:.0f} evaluations per search.\n")
    p = f.panels
    out.append("\n## 6. Frontier panels of class-B cells\n")
    out.append(f"One 2x2 panel per class-B cell (BOTH = the cell's selection; C1/C2 = its K and V parts, or the "
               f"two halves of its position range for one-component cells; one process repeat): "
               f"{_share(p['panels'], p['class_b_cells'])} run, {p['skipped']} without a split, {p['failed']} "
               f"failed. With a frontier t*: {p['with_frontier']}; nonzero interaction I at t*: "
               f"{_share(p['nonzero_interaction'], p['with_frontier'])}; sufficient top-1 condition "
               f"(margin > 2 eps_inf in all four arms) at t*: {_share(p['top1_condition'], p['with_frontier'])}.\n")
    if p["with_frontier"]:
        out.append(f"Median t* {p['median_t_star']:.0f}; median |I| {p['median_abs_interaction']:.4g}.\n")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- figures and files


def figures(f: Findings) -> dict[str, bytes]:
    out = {}
    for run in f.runs:
        out[f"classes-{run.name}"] = fig.class_overview(agreed_classes(run.ds), title=f"{run.name}: endpoint classes "
                                                        "(repeat-agreeing; blank: repeats disagree)")
    recs = [r for run in f.runs for r in run.panels if r.get("status") == "ok" and r.get("t_star", -1) >= 0
            and "interaction" in r]
    out["interaction"] = fig.histogram([r["interaction"] for r in recs], "interaction I at t*",
                                       f"frontier panels of class-B cells ({len(recs)} with a frontier)")
    mins = [r for run in f.runs for r in run.minimal if r.get("status") == "ok" and r.get("found")]
    out["minimal-sizes"] = fig.histogram([np.log10(max(r["selected_bytes"], 1)) for r in mins],
                                         "log10 bytes of the minimal sufficient selection",
                                         f"minimal sufficient selections ({len(mins)} searches)")
    return out


def write(runs_dirs, out) -> tuple[Path, Findings]:
    """Compute the findings of the study folders and write ``OUT/findings.md``,
    ``OUT/findings.json``, ``OUT/findings.nc`` (per-input natural-pair table) and
    ``OUT/figures/*.png``; returns the Markdown path."""
    runs = [load_run(d) for d in runs_dirs]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise FindingsInputError(f"two folders hold the same study ({', '.join(names)})")
    f = compute(runs)
    out = Path(out)
    _check_out(out, runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, FindingsInputError):  # one writer per findings folder
        _check_out(out, runs)
        made = not out.exists()
        out.mkdir(exist_ok=True)
        try:
            atomic_write_text(out / MARKER, json.dumps({"format": MARKER_FORMAT}) + "\n")
        except BaseException:
            if made:
                out.rmdir()
            raise
        return _write(out, runs, f), f


MARKER = ".statelab-findings"  # marks a findings folder as one: only such a folder (or a new one) is written
MARKER_FORMAT = "statelab.findings-folder/1"


def _check_out(out: Path, runs) -> None:
    """Refuse an output folder that is not a findings folder: an existing file, a folder
    holding other things (a capture, a study...) without the findings marker, or one of the
    study folders read."""
    if not out.exists():
        return
    if not out.is_dir() or out.is_symlink():
        raise FindingsInputError(f"{out} exists and is not a folder; name a new --out")
    if any(out.resolve() == r.root.resolve() for r in runs):
        raise FindingsInputError(f"{out} is one of the study folders read; name a new --out")
    names = [p.name for p in out.iterdir()]
    if not names:
        return
    if not (_json_of(out / MARKER).get("format") == MARKER_FORMAT
            or _LEGACY_KEYS <= set(_json_of(out / "findings.json"))):  # written before the marker existed
        raise FindingsInputError(f"{out} is not a findings folder (it holds other files and no {MARKER}); "
                                 "name a new or empty --out")


_LEGACY_KEYS = {"runs", "natural", "separability", "minimal", "panels"}


def _json_of(path: Path) -> dict:
    try:
        d = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _write(out: Path, runs, f) -> Path:
    md = markdown(f)
    figs = figures(f)
    (out / "figures").mkdir(exist_ok=True)
    for name, png in figs.items():
        write_file(out / "figures" / f"{name}.png", png)
    md += "\n## Figures\n\n" + "\n".join(f"![{n}](figures/{n}.png)" for n in figs) + "\n"
    atomic_write_text(out / "findings.json", json.dumps(f.as_dict(), indent=1, sort_keys=True, default=float))
    if f.natural:
        with atomic_path(out / "findings.nc") as tmp:
            natural_dataset(f).to_netcdf(tmp, engine="netcdf4")
    for run in runs:  # the studies' own results, compact enough to keep beside the tables
        with atomic_path(out / f"{run.name}-results.nc") as tmp:
            compact_results(run.ds, tmp)
        report = run.root / "report.md"
        if report.is_file():
            atomic_write_text(out / f"{run.name}-report.md", report.read_text())
    atomic_write_text(out / "findings.md", md)
    return out / "findings.md"


def compact_results(ds: xr.Dataset, path) -> None:
    """``ds`` as NetCDF with every variable deflated (level 9) and string variables stored as
    fixed-width bytes (HDF5 cannot deflate variable-length strings): the same values, a
    twentieth of the size for a study's results.nc."""
    ds = ds.copy()
    enc = {}
    for v in ds.data_vars:
        if ds[v].dtype.kind in "OU":
            width = max(1, max((len(str(x)) for x in ds[v].values.ravel()), default=1))
            ds[v] = ds[v].astype(f"S{width}")
        enc[v] = {"zlib": True, "complevel": 9}
    ds.to_netcdf(path, engine="netcdf4", encoding=enc)


def natural_dataset(f: Findings) -> xr.Dataset:
    """Per (run, task, arm pair): natural endpoints and states equal, and for the reference
    pairs of the controls the magnitudes of the state difference (NaN where not measured)."""
    sep = {(r["run"], r["task"], r["pair"]): r for r in f.separability_inputs}
    n = len(f.natural)
    data = {"endpoint_same": np.zeros(n, bool), "state_same": np.zeros(n, bool)}
    data.update({v: np.full(n, np.nan) for v, _ in MAGNITUDES})
    for i, r in enumerate(f.natural):
        data["endpoint_same"][i], data["state_same"][i] = r["endpoint_same"], r["state_same"]
        s = sep.get((r["run"], r["task"], r["pair"]))
        for v, _ in MAGNITUDES:
            if s is not None:
                data[v][i] = s[v]
    coords = {"run": ("row", [r["run"] for r in f.natural]), "task": ("row", [r["task"] for r in f.natural]),
              "pair": ("row", [r["pair"] for r in f.natural])}
    return xr.Dataset({k: ("row", v) for k, v in data.items()}, coords=coords,
                      attrs={"format": "statelab.findings/1"})
