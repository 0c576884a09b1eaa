"""Frontier panels on a real model: spec -> captures -> arm traces in fresh processes -> dataset.

A *panel* (paper S5.2) is one (task, recipient arm, direction, panel name) coordinate with
four subset crosses through the common receiver, each recorded with its full FP32 logit
trace: EMPTY, component 1 only, component 2 only and BOTH (the union of the two component
selections: ``L0 = L0_K | L0_V``, ``POSITION = PREFIX | TAIL = ALL``).  The analysis itself
is :mod:`statelab.analysis.frontier` (numpy/xarray only); this module produces and stores its inputs.

Spec (``studies/frontier-*.toml``)::

    name        = "frontier-ci"          # optional; default: the file stem
    description = "..."                  # optional
    model       = "path/to/model.gguf"   # optional; default: the embedded model
    backend     = "cpu"                  # cpu | cuda | vulkan
    threads     = 1                      # CPU threads of every context (0: $STATELAB_THREADS or all cores)
    n_ctx       = 1024
    cap         = 32                     # output cap of every arm (and of the natural controls)
    repeats     = 2                      # independent worker processes per (task, direction); >= 2
    prompts     = ["HumanEval/20", "file:x.txt", "text:..."]
    directions  = ["A->R", "R->A"]       # DONOR->RECIPIENT, arm names from [arms]
    panels      = ["POSITION", "L0"]     # names of frontier.PANEL_COMPONENTS, or a table (below)
    before_frontier = 1                  # also request contrasts at t*-1 .. t*-k (descriptive)
    share_identical = true               # arms whose imported payload is byte-identical share one run
    plot_window = 8                      # outputs before t* in the score plots

    [arms]                               # arm name -> prefill schedule (A, B, C, R or explicit)
    A = "A"
    R = "R"

    # instead of a list, panels may be a table NAME = [COMPONENT1, COMPONENT2] of selector
    # names (or .toml paths relative to the spec):  [panels]  EARLY_LATE = ["EARLY", "LATE"]

Run folder::

    OUT/spec.json                                   normalised spec, its hash, model identity
    OUT/captures/<task>/<arm>/                      archive.save_capture (natural endpoint in extra)
    OUT/traces/<task>/<donor>-<recipient>/r<k>/     one worker process: manifest.json + run*.npz
    OUT/results.nc  contrasts.md  report.md  plots/*.png

Each trace folder is written atomically by one worker process (forked from the fork server,
:mod:`statelab.experiments.forkserver`, function :func:`unit_result`) with a manifest of sha256 per file (:func:`archive.write_files_atomic`);
``run<i>.npz`` (compressed) holds ``tokens`` (int32, n_out) and ``logits`` (float32, n_out x
n_vocab; row t = the logits from which output t was chosen, row 0 = the recipient's captured
initial logits).  The manifest maps every panel arm to its run: with ``share_identical`` arms
whose mixed KV payload is byte-identical (for example all L0 arms on CPU, where A and R agree
bitwise in layer 0) are decoded once and share a ``trace_id``.  The EMPTY arm is the
recipient's sham and must reproduce its natural endpoint (a failed control stops the worker).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from statelab.analysis import frontier as F
from statelab.experiments import specfile as sf
from statelab.analysis.classes import first_difference
from statelab.analysis.frontier import frontier_rows
from statelab.lab.archive import ArchiveError, load_capture, read_verified, save_capture, write_files_atomic
from statelab.errors import ConfigError, IdentityError, StatelabError
from statelab.experiments import engine
from statelab.experiments.engine import Kind, Summary
from statelab.experiments.executors import Unit
from statelab.experiments.folder import RunFolder
from statelab.experiments.naming import Direction, parse_directions, slug
from statelab.lab.formation import differing_arms
from statelab.lab.intervene import account, natural, subset_cross
from statelab.paths import atomic_write_text, read_json_record
from statelab.lab.receiver import Endpoint
from statelab.resources import spec_file
from statelab.runtime import ContextConfig, Model, prepare_backend
from statelab.selection import Selection, apply_subset, load_selector, select
from statelab.experiments.specfile import SpecCommon, check_prompt_fits, spec_error

SPEC_FORMAT = "statelab.frontier-spec/1"
TRACE_FORMAT = "statelab.frontier-trace/1"
ARMS = ("EMPTY", "C1", "C2", "BOTH")
DEFAULT_PANELS = {"L0": ("L0_K", "L0_V"), "POSITION": ("PREFIX", "TAIL")}  # = frontier.PANEL_COMPONENTS

_TOP_KEYS = ("name", "description", "model", "backend", "threads", "n_ctx", "cap", "repeats", "prompts",
             "directions", "panels", "arms", "before_frontier", "share_identical", "plot_window")
_REQUIRED = ("prompts", "directions", "panels", "arms")


class FrontierRunError(ConfigError):
    """A frontier spec, run folder or stored trace that cannot be used, stated in one line."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------- spec


@dataclass
class FrontierSpec(SpecCommon):
    panels: dict  # name -> (component1, component2) selector names
    selectors: dict  # component name -> Selector
    before_frontier: int = 0
    share_identical: bool = True
    plot_window: int = 8
    model_path: str = ""
    model_sha256: str = ""
    n_layer: int = 0
    selector_dirs: tuple[str, ...] = field(default_factory=tuple)

    def normalized(self) -> dict:
        return {
            "format": SPEC_FORMAT, "name": self.name, "model_sha256": self.model_sha256, "backend": self.backend,
            "threads": self.threads, "n_ctx": self.n_ctx, "cap": self.cap, "repeats": self.repeats,
            "prompts": [{"spec": s, "id": p.id, "sha256": p.identity} for s, p in zip(self.prompt_specs, self.prompts)],
            "arms": {n: s.as_dict() for n, s in self.arms.items()},
            "directions": self.direction_labels,
            "panels": [{"name": n, "components": list(c), "terms": [self.selectors[x].describe() for x in c]}
                       for n, c in self.panels.items()],
            "share_identical": self.share_identical,
        }

    @property
    def hash(self) -> str:
        return _sha(json.dumps(self.normalized(), sort_keys=True).encode())

    def record(self) -> dict:
        """What OUT/spec.json holds: the hashed normal form plus analysis settings and sources;
        for ``chat:`` prompts (their identity is not their text's hash) the rendered texts'
        sha256, which every capture and trace of the run records (rendered here, at run time,
        not when the spec is validated)."""
        rendered = {p.id: p.sha256 for p in self.prompts if p.identity != p.sha256}
        return {
            "format": SPEC_FORMAT, "spec_hash": self.hash, "normalized": self.normalized(),
            "spec_path": str(self.path), "description": self.description, "model_path": self.model_path,
            "n_layer": self.n_layer, "before_frontier": self.before_frontier, "plot_window": self.plot_window,
            "selector_sources": {n: s.source for n, s in self.selectors.items()},
            "selector_dirs": list(self.selector_dirs),
            **({"prompt_text_sha256": rendered} if rendered else {}),
        }


def _err(path, msg: str) -> FrontierRunError:
    return spec_error(FrontierRunError, "frontier spec", path, msg)


def load_spec(path: str | os.PathLike, check_model: bool = True) -> FrontierSpec:
    """Parse and validate a frontier spec; every error is a one-line :class:`FrontierRunError`.
    With ``check_model`` the GGUF header is read (no weights) to check selector layers."""
    path = spec_file(path)
    data = sf.load_toml_spec(path, "frontier spec", FrontierRunError, _TOP_KEYS, _REQUIRED)

    def err(msg: str) -> FrontierRunError:
        return _err(path, msg)

    common = sf.common_fields(data, path, err, cap_default=32)
    if common["repeats"] < 2:
        raise err("'repeats' must be >= 2 (repeat agreement needs two independent processes), "
                  f"got {common['repeats']}")
    before = sf.int_field(data, "before_frontier", 0, 0, err)
    window = sf.int_field(data, "plot_window", 8, 0, err)
    share = data.get("share_identical", True)
    if not isinstance(share, bool):
        raise err(f"'share_identical' must be true or false, got {share!r}")

    prompt_specs = sf.str_list(data, "prompts", err)
    prompts = sf.resolve_prompts(prompt_specs, path, err)
    ids = [p.id for p in prompts]
    if len({slug(i) for i in ids}) != len(ids):
        raise err(f"prompts {ids} repeat or do not map to distinct folder names")

    arms = sf.parse_arms(data, err)

    directions = parse_directions(sf.str_list(data, "directions", err), arms, err)

    raw_panels = data["panels"]
    panels: dict[str, tuple[str, str]] = {}
    if isinstance(raw_panels, list):
        for p in sf.str_list(data, "panels", err):
            if p not in DEFAULT_PANELS:
                raise err(f"unknown panel {p!r}: known {', '.join(DEFAULT_PANELS)}; define others as a "
                                 "table NAME = [COMPONENT1, COMPONENT2]")
            panels[p] = DEFAULT_PANELS[p]
    elif isinstance(raw_panels, dict) and raw_panels:
        for p, comps in raw_panels.items():
            if not sf.NAME_RE.match(p):
                raise err(f"panel name {p!r} must be letters, digits or underscore")
            if not (isinstance(comps, list) and len(comps) == 2 and all(isinstance(c, str) for c in comps)):
                raise err(f"panel {p}: give exactly two component selectors, got {comps!r}")
            if comps[0] == comps[1]:
                raise err(f"panel {p}: the two components are the same selector {comps[0]!r}")
            if p in DEFAULT_PANELS and tuple(comps) != DEFAULT_PANELS[p]:
                raise err(f"panel {p} is predefined with components {DEFAULT_PANELS[p]}; use another name")
            panels[p] = (comps[0], comps[1])
    else:
        raise err("'panels' must be a list of panel names or a table NAME = [COMPONENT1, COMPONENT2]")

    search = sf.selector_search_dirs(path)
    selectors = {}
    for comps in panels.values():
        for c in comps:
            if c not in selectors:
                selectors[c] = sf.load_spec_selector(c, path, search, err)

    spec = FrontierSpec(path=path.resolve(), **common, prompt_specs=tuple(prompt_specs), prompts=prompts,
                        arms=arms, directions=tuple(directions), panels=panels, selectors=selectors,
                        before_frontier=before, share_identical=share, plot_window=window,
                        selector_dirs=tuple(search))
    if check_model:
        sf.check_against_model(spec, err)
    return spec


# ------------------------------------------------------------------------- one recipient


@dataclass
class PanelRuns:
    """The subset crosses of every panel for one (donor, recipient) pair, decoded once per
    distinct imported payload.  ``runs``: run id -> Endpoint (with ``trace``);
    ``arms``: panel -> arm code -> run id; ``imports``: panel -> arm code -> accounting."""

    runs: dict
    run_info: dict
    arms: dict
    imports: dict


def run_panels(model, donor, recipient, panels: dict, cap: int, share_identical: bool = True,
               contexts=None) -> PanelRuns:
    """Run the four arms of each panel as subset crosses (``panels``: name -> (Selector, Selector)).
    ``contexts`` (a ``runtime.ContextPool``): decode in its cleared contexts, not new ones.

    BOTH is the union of the two component selections.  With ``share_identical`` an arm whose
    mixed KV payload equals an earlier arm's byte for byte reuses that run (identical inputs to
    the common receiver); its own selection and byte accounting are still recorded.
    """

    rstate, dstate = recipient.state, donor.state
    runs, run_info, arms, imports = {}, {}, {}, {}
    by_payload: dict[str, str] = {}
    for pname, (s1, s2) in panels.items():
        c1, c2 = select(s1, rstate), select(s2, rstate)
        empty = Selection([np.zeros_like(m) for m in c1.k], [np.zeros_like(m) for m in c1.v], c1.k_itemsize,
                          c1.v_itemsize, c1.v_trans, "EMPTY")
        both = c1.union(c2)
        both.name = "BOTH"
        arms[pname], imports[pname] = {}, {}
        for code, sel, label in (("EMPTY", empty, "EMPTY"), ("C1", c1, s1.name), ("C2", c2, s2.name),
                                 ("BOTH", both, f"{s1.name} ∪ {s2.name}")):
            mixed = apply_subset(rstate, dstate, sel)
            payload = _sha(mixed.to_bytes())
            acc = account(rstate, mixed, int(sel.selected_bytes), True)
            imports[pname][code] = {"selection": label, "selected_bytes": int(sel.selected_bytes),
                                    "changed_bytes": int(acc.changed_bytes), "max_abs": float(acc.max_abs),
                                    "payload_sha256": payload}
            key = payload if share_identical else f"{pname}/{code}"
            if key not in by_payload:
                rid = f"run{len(runs)}"
                t0 = time.perf_counter()
                ep, _ = subset_cross(model, donor, recipient, sel, cap, trace=True, contexts=contexts)
                if ep.trace is None or ep.trace.shape[0] != ep.length:
                    raise FrontierRunError(f"subset cross {pname}/{code} returned no aligned logit trace")
                runs[rid] = ep
                run_info[rid] = {"first_arm": f"{pname}/{code}", "payload_sha256": payload,
                                 "n_tokens": ep.length, "eog": bool(ep.eog), "stop_reason": ep.stop_reason,
                                 "seconds": time.perf_counter() - t0}
                by_payload[key] = rid
            arms[pname][code] = by_payload[key]
    return PanelRuns(runs, run_info, arms, imports)


def panel_dataset(pr: PanelRuns, panel: str, task: str, recipient: str, direction: str, components,
                  model_sha256: str, prompt_sha256: str, trace_id=lambda rid: rid):
    """One panel of :func:`run_panels`' runs (one process repeat) analysed by
    :func:`statelab.analysis.frontier.analyse_panel`: the in-process path of the demo and the
    findings follow-ups (a frontier run analyses its stored traces, :func:`analyse_run`)."""
    traces = [F.ArmTrace(arm, 0, pr.runs[rid].tokens, pr.runs[rid].trace, model_sha256, prompt_sha256,
                         trace_id=trace_id(rid)) for arm, rid in pr.arms[panel].items()]
    return F.analyse_panel(task, recipient, panel, direction, traces, components=tuple(components))


def _npz_bytes(tokens: np.ndarray, logits: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=np.asarray(tokens, np.int32), logits=np.asarray(logits, np.float32))
    return buf.getvalue()


def _load_npz(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            tokens, logits = z["tokens"], z["logits"]
    except (ValueError, KeyError, OSError) as e:
        raise FrontierRunError(f"{where}: not a trace file with 'tokens' and 'logits' ({e})") from None
    if tokens.ndim != 1 or logits.ndim != 2 or logits.shape[0] != tokens.shape[0]:
        raise FrontierRunError(f"{where}: {tokens.shape[0] if tokens.ndim else '?'} tokens but logits of shape "
                               f"{logits.shape}; a full trace has one logit row per output")
    return tokens, logits


def _text_sha256(spec_record: dict, task: dict) -> str:
    """The rendered text's sha256 of a spec.json prompt (recorded for ``chat:`` prompts; any
    other prompt's identity is its text's sha256)."""
    return (spec_record.get("prompt_text_sha256") or {}).get(task["id"], task["sha256"])


def _unit_task(spec_record: dict, out: Path, task: dict, direction: str, repeat: int) -> dict:
    norm = spec_record["normalized"]
    donor, recip = Direction.parse(direction)
    cdir = out / "captures" / slug(task["id"])
    return {
        "key": f"{task['id']}|{direction}|{repeat}", "spec_hash": spec_record["spec_hash"],
        "task": task["id"], "prompt_sha256": _text_sha256(spec_record, task), "direction": direction, "donor": donor,
        "recipient": recip, "repeat": int(repeat), "cap": norm["cap"], "backend": norm["backend"],
        "model": spec_record["model_path"], "model_sha256": norm["model_sha256"],
        "donor_capture": str((cdir / donor).resolve()), "recipient_capture": str((cdir / recip).resolve()),
        "panels": {p: {"components": v["components"], "terms": v["terms"],
                       "sources": [spec_record["selector_sources"][c] for c in v["components"]]}
                   for p, v in _panels(norm)},
        "selector_dirs": spec_record["selector_dirs"], "share_identical": norm["share_identical"],
        "dest": str(trace_dir(out, task["id"], direction, repeat).resolve()),
    }


def _panels(norm: dict) -> list[tuple[str, dict]]:
    """(name, {components, terms}) in spec order."""
    return [(p["name"], p) for p in norm["panels"]]


def trace_dir(out: Path, task: str, direction: str, repeat: int) -> Path:
    return Path(out) / "traces" / slug(task) / Direction.parse(direction).folder / f"r{int(repeat)}"


def run_unit(task: dict, model=None) -> dict:
    """One worker: load model and captures (verified), run every panel's arms, check the
    EMPTY control against the recipient's natural endpoint, write the trace folder."""

    t0 = time.perf_counter()
    if model is None:
        model = Model(task["model"], backend=task["backend"])
    if model.sha256 != task["model_sha256"]:
        raise IdentityError(f"the worker's model {model.sha256[:12]} is not the run's {task['model_sha256'][:12]}")
    donor, recipient = load_capture(task["donor_capture"]), load_capture(task["recipient_capture"])
    for c, role in ((donor, "donor"), (recipient, "recipient")):
        if c.prompt_sha256 != task["prompt_sha256"]:
            raise IdentityError(f"{role} capture {c.prompt_id} is not of prompt {task['task']}")
    panels = {}
    for p, v in task["panels"].items():
        sels = []
        for src, terms in zip(v["sources"], v["terms"]):
            s = load_selector(src, search_dirs=task["selector_dirs"])
            if s.describe() != terms:
                raise FrontierRunError(f"selector {s.name} changed since the run started: {s.describe()!r}")
            sels.append(s)
        panels[p] = tuple(sels)
    nat = recipient.extra.get("natural")
    nat_d = donor.extra.get("natural")
    if nat is None or recipient.extra.get("natural_cap") != task["cap"]:
        raise FrontierRunError(f"recipient capture {task['recipient_capture']} has no natural endpoint at cap "
                               f"{task['cap']}")
    natural_r = Endpoint.from_dict(nat)
    t_ready = time.perf_counter()
    pr = run_panels(model, donor, recipient, panels, int(task["cap"]), bool(task["share_identical"]))
    for p, m in pr.arms.items():
        ep = pr.runs[m["EMPTY"]]
        if not ep.same(natural_r):
        
            raise FrontierRunError(
                f"FAILED CONTROL {task['key']} panel {p}: the EMPTY arm (recipient sham) differs from the recipient's "
                f"natural endpoint at output {first_difference(ep.tokens, natural_r.tokens)}")
    files, runs = {}, {}
    for rid, ep in pr.runs.items():
        files[f"{rid}.npz"] = _npz_bytes(ep.tokens, ep.trace)
        runs[rid] = dict(pr.run_info[rid], file=f"{rid}.npz",
                         pieces={str(t): model.detokenize([t]) for t in sorted({int(x) for x in ep.tokens})})
    manifest = {
        "format": TRACE_FORMAT, "spec_hash": task["spec_hash"], "task": task["task"],
        "prompt_sha256": task["prompt_sha256"], "model_sha256": model.sha256, "backend": task["backend"],
        "direction": task["direction"], "donor": task["donor"], "recipient": task["recipient"],
        "repeat": task["repeat"], "cap": task["cap"], "n_vocab": int(next(iter(pr.runs.values())).trace.shape[1]),
        "n_prompt": recipient.n_prompt,
        "donor_kv_sha256": donor.hashes()["kv"], "recipient_kv_sha256": recipient.hashes()["kv"],
        "recipient_logits_sha256": recipient.hashes()["logits"],
        "natural_recipient": nat, "natural_donor": nat_d, "control": "EMPTY equals the recipient's natural endpoint",
        "panels": {p: {"components": task["panels"][p]["components"], "arms": pr.arms[p], "imports": pr.imports[p]}
                   for p in pr.arms},
        "runs": runs, "pid": os.getpid(), "host": socket.gethostname(),
        "timing": {"prepare_s": t_ready - t0, "runs_s": time.perf_counter() - t_ready},
    }
    write_files_atomic(Path(task["dest"]), files, manifest, overwrite=True)
    return {"key": task["key"], "runs": len(runs), "seconds": time.perf_counter() - t0, "pid": os.getpid()}


UNIT_FN = "statelab.experiments.frontier_panels:unit_result"


def unit_result(task: dict) -> dict:
    """What a unit's fresh process returns: :func:`run_unit`'s result, or ``{"error": line}``
    for a failure stated to the user (a crash ends the process without a result)."""
    try:
        return run_unit(task)
    except (StatelabError, ValueError) as e:
        return {"error": " ".join(str(e).split())}


# ---------------------------------------------------------------------------------- run


def _capture_kv_sha(folder: str) -> str | None:
    try:
        return json.loads((Path(folder) / "manifest.json").read_text())["hashes"]["kv"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _unit_done(task: dict) -> bool:
    """A verified trace folder of this spec, made from the captures now on disk."""

    dest = Path(task["dest"])
    if not (dest / "manifest.json").is_file():
        return False
    try:
        manifest, _ = read_verified(dest, TRACE_FORMAT)
    except ArchiveError:
        return False
    return (manifest.get("spec_hash") == task["spec_hash"]
            and manifest.get("donor_kv_sha256") == _capture_kv_sha(task["donor_capture"])
            and manifest.get("recipient_kv_sha256") == _capture_kv_sha(task["recipient_capture"]))


def _captures(spec: FrontierSpec, out: Path, say) -> None:
    """Form every needed capture once (with its natural endpoint as control) and archive it."""

    needed = list(dict.fromkeys(a for d in spec.directions for a in d))
    todo = []
    for p in spec.prompts:
        for arm in needed:
            dest = out / "captures" / slug(p.id) / arm
            if dest.exists():
                try:
                    c = load_capture(dest)
                    if (c.prompt_sha256 == p.sha256 and c.identity.get("model_sha256") == spec.model_sha256
                            and c.schedule == spec.arms[arm] and c.extra.get("natural_cap") == spec.cap):
                        continue
                except ArchiveError:
                    pass
            todo.append((p, arm, dest))
    if not todo:
        return
    prepare_backend(spec.backend)
    model = Model(spec.model_path, backend=spec.backend)
    try:
        base = ContextConfig(backend=spec.backend, n_threads=spec.threads, n_ctx=spec.n_ctx)
        for p, arm, dest in todo:
            n = len(model.tokenize(p.text))
            check_prompt_fits(p.id, n, spec.n_ctx, {arm: spec.arms[arm]}, lambda msg: _err(spec.path, msg),
                              spec.cap)
            t0 = time.perf_counter()
            cap_, ep = natural(model, p, spec.arms[arm], base, spec.cap)
            cap_.extra.update(natural=ep.as_dict(), natural_cap=spec.cap)
            save_capture(cap_, dest, overwrite=True)
            say(f"capture {p.id} arm {arm}: {n} tokens, natural endpoint {ep.length} outputs "
                f"({time.perf_counter() - t0:.1f} s)")
    finally:
        model.close()


def plan_units(spec: FrontierSpec, out: Path) -> list[dict]:
    """One task per (prompt, direction, repeat), in spec order."""
    rec = spec.record()
    return [_unit_task(rec, out, t, d, r) for t in rec["normalized"]["prompts"]
            for d in spec.direction_labels for r in range(spec.repeats)]


def compile_run(out: Path):
    """The stored traces -> (:class:`Analysis`, the written outputs' paths); no model needed."""
    result = analyse_run(out)
    return result, write_outputs(out, result)


def unit_failed(task: dict, error: str) -> dict:
    return {"key": task["key"], "error": " ".join(str(error).split())}


def _accept(run, res: dict) -> dict:
    """A unit's trace folder is its durable record (written by the unit itself); here only
    the line the caller hears and the failure, kept for the end of the run."""
    say, todo = run.options.get("say", lambda msg: None), run.state["todo_n"]
    run.state["seen"] += 1
    where = f"[{run.state['seen']}/{todo}] {res['key']}"
    if "error" in res:
        run.state["failed"].append((res["key"], res["error"]))
        say(f"{where}: FAILED {res['error']}")
        return {"key": res["key"], "status": "failed", "error": res["error"]}
    say(f"{where}: {res['runs']} runs in process {res['pid']} ({res['timing']['subprocess_s']:.1f} s)")
    return {**res, "status": "ok"}


def _prepare(run) -> None:
    """spec.json first (the captures are this spec's), then every needed capture once."""
    run.claim()
    _captures(run.spec, run.out, run.options.get("say", lambda msg: None))


def _plan(run) -> tuple[list[dict], list]:
    units = plan_units(run.spec, run.out)
    done = {u["key"] for u in units if _unit_done(u)}  # verified trace folders of the captures on disk
    run.state.update(failed=[], seen=0, done=done, todo_n=len(units) - len(done))
    return units, []


def _compile(run) -> dict:
    failed = run.state["failed"]
    if failed:
        key, error = failed[0]
        raise FrontierRunError(f"{len(failed)} of {run.state['todo_n']} worker(s) failed; first {key}: {error}")
    result, paths = compile_run(run.out)
    agree = result.agreement.attrs
    return {"analysis": result, **paths, "report_path": paths["report"], "results_path": paths["results"],
            "n_frontiers": result.n_frontiers, "agreement": (int(agree["n_agree"]), int(agree["n_compared"]))}


FRONTIER = Kind(
    "frontier", "statelab.experiments.frontier_panels", FrontierRunError, load_spec,
    folder=lambda spec, out: RunFolder(Path(out) if out is not None else Path("runs") / "frontier" / slug(spec.name),
                                       SPEC_FORMAT, FrontierRunError, "frontier"),
    identity=lambda run: (run.spec.hash, run.spec.record()),
    prepare=_prepare,
    plan=_plan, done=lambda run: run.state["done"],
    unit=lambda run: Unit(UNIT_FN, unit_failed, {"STATELAB_THREADS": str(run.spec.threads)} if run.spec.threads else {}),
    accept=_accept, compile=_compile)


def run_frontier(spec_path, out=None, workers: int = 1, say=lambda msg: None, executor: str = "local") -> Summary:
    """Run (or resume) a frontier spec through the engine: captures once (the kind's
    preparation), then one fresh worker process per (task, direction, repeat), then
    :func:`analyse_run` and the outputs."""
    return engine.run(FRONTIER, spec_path, out, executor, workers, say=say)


def reanalyse(out, page=None) -> tuple["Analysis", dict, object]:
    """``frontier analyse``: :func:`analyse_run` and the outputs of a run folder, written as
    its one writer (a folder in use, or one that is not a frontier run folder, is refused and
    left as it was); ``page(out, ds)`` (the HTML page) is written under the same lock."""
    folder = RunFolder(Path(out), SPEC_FORMAT, FrontierRunError, "frontier")
    if not folder.spec_path.is_file():  # refused before the lock: nothing is made in the folder
        raise FrontierRunError(f"not a frontier run folder (no spec.json): {out}")
    with folder.writer(create=False):
        r = analyse_run(out)
        paths = write_outputs(out, r)
        return r, paths, None if page is None else page(out, r.ds)


# ----------------------------------------------------------------------------- analysis


@dataclass
class Analysis:
    ds: object  # xarray.Dataset (canonicalised)
    agreement: object  # xarray.Dataset from frontier.score_repeat_agreement
    spec: dict
    units: dict  # (task, direction, repeat) -> trace manifest (without the file list)

    @property
    def n_frontiers(self) -> int:
        return int((self.ds["t_star"] >= 0).sum())


def _wrap(e: Exception, where: str) -> FrontierRunError:
    return FrontierRunError(f"{where}: {' '.join(str(e).split())}")


def _load_unit(out: Path, task: dict, direction: str, repeat: int):

    dest = trace_dir(out, task["id"], direction, repeat)
    rel = dest.relative_to(out)
    if not (dest / "manifest.json").is_file():
        raise FrontierRunError(f"{rel}: trace folder missing; the run is incomplete "
                               "(run `statelab frontier run` again to resume)")
    manifest, files = read_verified(dest, TRACE_FORMAT)
    for key, want in (("task", task["id"]), ("direction", direction), ("repeat", repeat)):
        if manifest.get(key) != want:
            raise FrontierRunError(f"{rel}: manifest says {key} {manifest.get(key)!r}, the folder holds {want!r}")
    runs = {}
    for rid, info in manifest.get("runs", {}).items():
        name = info.get("file")
        if name not in files:
            raise FrontierRunError(f"{rel}: run {rid} file {name!r} is not listed in the manifest")
        runs[rid] = _load_npz(files[name], f"{rel}/{name}")
    return rel, manifest, runs


def analyse_run(out) -> Analysis:
    """Recompute the dataset of a run folder from its stored traces (no model needed)."""

    out = Path(out)
    spec = read_json_record(out / "spec.json", SPEC_FORMAT, FrontierRunError,
                            missing="not a frontier run folder (no spec.json): {folder}")
    norm = spec["normalized"]
    before = int(spec.get("before_frontier", 0))
    datasets, units = [], {}
    for task in norm["prompts"]:
        for direction in norm["directions"]:
            recipient = Direction.parse(direction).recipient
            loaded = [_load_unit(out, task, direction, r) for r in range(norm["repeats"])]
            for (rel, manifest, _), r in zip(loaded, range(norm["repeats"])):
                units[(task["id"], direction, r)] = {k: v for k, v in manifest.items() if k != "files"}
                for key in ("donor_kv_sha256", "recipient_kv_sha256", "recipient_logits_sha256"):
                    if manifest.get(key) != loaded[0][1].get(key):
                        raise FrontierRunError(f"{rel}: {key.replace('_sha256', '')} differs from repeat 0's: the "
                                               "repeats were not run from the same captures")
            for pname, pinfo in _panels(norm):
                comps = tuple(pinfo["components"])
                traces = []
                for r, (rel, manifest, runs) in enumerate(loaded):
                    panel = manifest.get("panels", {}).get(pname)
                    if panel is None:
                        raise FrontierRunError(f"{rel}: the manifest has no panel {pname}")
                    if tuple(panel.get("components", ())) != comps:
                        raise FrontierRunError(f"{rel}: panel {pname} has components {panel.get('components')}, "
                                               f"the spec {list(comps)}")
                    for arm, rid in panel.get("arms", {}).items():
                        if rid not in runs:
                            raise FrontierRunError(f"{rel}: panel {pname} arm {arm} refers to unknown run {rid!r}")
                        tokens, logits = runs[rid]
                        traces.append(F.ArmTrace(arm, r, tokens, logits, str(manifest.get("model_sha256", "")),
                                                 str(manifest.get("prompt_sha256", "")),
                                                 trace_id=f"{rel.parent}/r{r}/{rid}"))
                where = f"{task['id']} {direction} panel {pname}"
                try:
                    ds = F.analyse_panel(task["id"], recipient, pname, direction, traces, components=comps)
                    ts = ds["t_star"].values.ravel()
                    if before and (ts >= 0).any():
                        m = int(ts[ts >= 0].min())
                        lim = int(ds["last_position"].values.min())
                        extra = [m - k for k in range(1, before + 1) if 0 <= m - k <= lim]
                        if extra:
                            ds = F.analyse_panel(task["id"], recipient, pname, direction, traces,
                                                 components=comps, positions=extra)
                except F.FrontierError as e:
                    raise _wrap(e, where) from None
                got_m = str(ds["model_sha256"].values.ravel()[0])
                got_p = str(ds["prompt_sha256"].values.ravel()[0])
                if got_m != norm["model_sha256"]:
                    raise FrontierRunError(f"{where}: traces were made with model {got_m[:12]}, the run's model is "
                                           f"{norm['model_sha256'][:12]}")
                if got_p != _text_sha256(spec, task):
                    raise FrontierRunError(f"{where}: traces were made on prompt {got_p[:12]}, {task['id']} is "
                                           f"{_text_sha256(spec, task)[:12]}")
                datasets.append(ds)
            del loaded
    try:
        ds = F.canonicalise(F.combine(datasets), reference_direction=norm["directions"][0])
    except F.FrontierError as e:
        raise _wrap(e, str(out)) from None
    ds.attrs.update(spec_name=norm["name"], spec_hash=spec["spec_hash"], model_sha256=norm["model_sha256"],
                    backend=norm["backend"], cap=int(norm["cap"]), repeats=int(norm["repeats"]),
                    reference_direction=norm["directions"][0])
    return Analysis(ds, F.score_repeat_agreement(ds), spec, units)


# ------------------------------------------------------------------------------ reports


def _f(x: float) -> str:
    return f"{x:+.6f}"


def summary_markdown(ds, agreement=None, pieces=None) -> str:
    """Frontier table (one line per panel repeat) plus a line for every panel without a frontier."""
    rows = frontier_rows(ds, agreement)
    comp = {str(p): [str(x) for x in ds["component"].sel(panel=p).values] for p in ds["panel"].values}
    head = ("| task | recipient | panel (C1/C2) | direction | repeat | t* | pair a/b | tokens at t* (EMPTY/C1/C2/BOTH) "
            "| s(EMPTY) | s(C1) | s(C2) | s(BOTH) | additive | joint | I | top-1 |")
    if agreement is not None:
        head += " repeats |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    none = []
    for r in rows:
        c1, c2 = comp[r["panel"]][1:3]
        if r["t_star"] < 0:
            none.append(f"- {r['task']} {r['direction']} {r['panel']} ({c1}/{c2}) repeat {r['repeat']}: no frontier: "
                        f"all four arms agree on outputs 0..{r['last']} (the whole trajectory)")
            continue
        if "scores" not in r:
            none.append(f"- {r['task']} {r['direction']} {r['panel']} repeat {r['repeat']}: t* = {r['t_star']} "
                        "(a trajectory ended early), no token pair")
            continue
        pair = f"{r['token_a']}/{r['token_b']}"
        if pieces is not None:
            pa, pb = pieces(r["task"], r["token_a"]), pieces(r["task"], r["token_b"])
            pair += f" ({pa!r}/{pb!r})".replace("|", "\\|")
        if r["flipped"]:
            pair += " (flipped)"
        lines.append("| " + " | ".join([
            r["task"], r["recipient"], f"{r['panel']} ({c1}/{c2})", r["direction"], str(r["repeat"]),
            str(r["t_star"]), pair, "/".join(str(t) for t in r["tokens"]), *(_f(s) for s in r["scores"]),
            _f(r["additive"]), _f(r["joint"]), _f(r["interaction"]), "holds" if r["top1"] else "fails",
            *([{True: "agree", False: "DIFFER"}.get(r.get("agree"), "—")] if agreement is not None else [])]) + " |")
    parts = []
    if len(lines) > 2:
        parts.append("\n".join(lines))
    else:
        parts.append("No panel has a frontier within the cap.")
    if none:
        parts.append("\n".join(none))
    parts.append("Scores are logit(a) - logit(b) of the frontier pair; additive = s(C1) + s(C2) - s(EMPTY); "
                 "I = s(BOTH) - additive.  Pairs are canonicalised to the first direction's order "
                 "(flipped rows change the sign of every score).")
    return "\n\n".join(parts) + "\n"


def _pieces_lookup(units: dict):
    table: dict = {}
    for (task, _d, _r), m in units.items():
        for info in m.get("runs", {}).values():
            for tok, piece in info.get("pieces", {}).items():
                table.setdefault((task, int(tok)), piece)
    return lambda task, tok: table.get((task, int(tok)), "?")


def write_outputs(out, result: Analysis) -> dict:
    """results.nc, contrasts.md, report.md and plots/ (score plots around every t*)."""

    out = Path(out)
    ds, agr, spec = result.ds, result.agreement, result.spec
    norm = spec["normalized"]
    results = F.save_results(ds, out / "results.nc")
    contrast_md = F.contrast_table_markdown(ds)
    contrasts = atomic_write_text(out / "contrasts.md", contrast_md)
    plots_dir = out / "plots"
    plots_dir.mkdir(exist_ok=True)
    for old in plots_dir.glob("*.png"):
        old.unlink()
    plots = []
    for r in frontier_rows(ds):
        if r["t_star"] >= 0 and "scores" in r and r["repeat"] == int(ds["repeat"].values[0]):
            coord = {k: r[k] for k in ("task", "recipient", "panel", "direction", "repeat")}
            name = slug(f"{r['task']}_{r['panel']}_{Direction.parse(r['direction']).folder}_r{r['repeat']}") + ".png"
            F.plot_scores(ds, coord, plots_dir / name, window=int(spec.get("plot_window", 8)))
            plots.append(name)

    pieces = _pieces_lookup(result.units)
    arms_txt = ", ".join(f"{a}={s['name']}" for a, s in norm["arms"].items())
    panels_txt = ", ".join(f"{p} ({'/'.join(v['components'])})" for p, v in _panels(norm))
    md = [f"# Frontier panels: {norm['name']}\n",
          f"spec hash `{spec['spec_hash'][:16]}`, model `{norm['model_sha256'][:16]}` ({spec.get('model_path', '')}), "
          f"backend {norm['backend']}, threads {norm['threads']}, cap {norm['cap']}, {norm['repeats']} process "
          f"repeats, arms {arms_txt}, directions {', '.join(norm['directions'])}, panels {panels_txt}.\n"]
    if spec.get("description"):
        md.append(spec["description"] + "\n")
    md.append("## Natural endpoints and controls\n")
    md.append("| task | n_prompt | direction | recipient natural | donor natural | first difference | "
              "EMPTY = recipient natural |\n|---|---|---|---|---|---|---|")
    by_pair: dict = {}
    for (task, d, _r), u in result.units.items():
        by_pair.setdefault((task, d), []).append(u)
    for (task, d), reps in by_pair.items():
        m = reps[0]
        passed = sum(1 for u in reps if u.get("control"))
        nr, nd = m.get("natural_recipient") or {}, m.get("natural_donor") or {}
        a, b = nr.get("tokens", []), nd.get("tokens", [])
        fd = first_difference(a, b)
        md.append(f"| {task} | {m.get('n_prompt', '?')} | {d} | {len(a)} outputs ({nr.get('stop_reason')}) | "
                  f"{len(b)} outputs ({nd.get('stop_reason')}) | {'=' if fd is None else fd} | "
                  f"passed in {passed} of {len(reps)} repeats |")
    md.append("\n## Frontiers\n")
    md.append(summary_markdown(ds, agr, pieces))
    a = agr.attrs
    md.append(f"Repeat agreement (bitwise: t*, pair, every score, margin, argmax, eps_inf, additive, joint, I): "
              f"{a['n_agree']} of {a['n_compared']} compared contrasts agree.\n")
    acc = F.condition_accounting(ds)
    md.append("## Conditions (direction symmetry, S5.3)\n\n| panel | repeat rows | oriented | conditions | inputs |\n"
              "|---|---|---|---|---|")
    for p, v in acc.items():
        md.append(f"| {p} | {v['rows']} | {v['oriented']} | {v['conditions']} | {v['inputs']} |")
    md.append("\n## Imports (repeat 0)\n\n| task | direction | panel | arm | selection | selected bytes | "
              "changed bytes | run |\n|---|---|---|---|---|---|---|---|")
    for (task, d, r), m in result.units.items():
        if r != 0:
            continue
        for p, pv in m.get("panels", {}).items():
            for arm in ARMS:
                imp = pv.get("imports", {}).get(arm, {})
                md.append(f"| {task} | {d} | {p} | {arm} | {imp.get('selection', '')} | "
                          f"{imp.get('selected_bytes', '')} | {imp.get('changed_bytes', '')} | "
                          f"{pv.get('arms', {}).get(arm, '')} |")
    md.append("\nArms with the same run imported byte-identical KV payloads and were decoded once per process.\n")
    md.append("## All contrasts\n")
    md.append(contrast_md)
    if plots:
        md.append("## Plots\n")
        md += [f"![{p}](plots/{p})" for p in plots]
    report = atomic_write_text(out / "report.md", "\n".join(md) + "\n")
    return {"results": results, "contrasts": contrasts, "report": report, "plots": [plots_dir / p for p in plots]}


# --------------------------------------------------------------------------------- demo


def frontier_section(model, base_config, prompts: list, cap: int = 48, arms: dict | None = None,
                     directions: list[tuple[str, str]] | None = None, panels=("L0", "POSITION"),
                     say=lambda msg: None, results_path=None) -> str:
    """The frontier panels of ``prompts`` as a Markdown section (``statelab demo``).

    In-process and one repeat per direction, to keep the demo cheap: ``statelab frontier run``
    runs independent process repeats and stores the traces.  ``arms``: name -> Schedule
    (default: the presets that differ on the backend, ``lab.formation.differing_arms``); ``directions``: (donor, recipient) pairs
    (default: both ways between the first two arms).
    """

    if arms is None:
        arms = differing_arms(base_config.backend)
    if directions is None:
        a0, a1 = list(arms)[:2]
        directions = [(a0, a1), (a1, a0)]
    sels = {p: tuple(load_selector(c) for c in DEFAULT_PANELS[p]) for p in panels}
    datasets, notes = [], []
    t0 = time.perf_counter()
    for p in prompts:
        caps = {}
        for arm in dict.fromkeys(x for d in directions for x in d):
            caps[arm] = natural(model, p, arms[arm], base_config, cap)
        for donor, recip in directions:
            pr = run_panels(model, caps[donor][0], caps[recip][0], sels, cap)
            if not pr.runs[pr.arms[panels[0]]["EMPTY"]].same(caps[recip][1]):
                notes.append(f"- FAILED CONTROL {p.id} {donor}->{recip}: the EMPTY arm differs from the natural "
                             "endpoint")
            for pname in panels:
                datasets.append(panel_dataset(pr, pname, p.id, recip, f"{donor}->{recip}", DEFAULT_PANELS[pname],
                                              model.sha256, p.sha256,
                                              trace_id=lambda rid: f"{p.id}/{donor}->{recip}/{rid}"))
                if len(set(pr.arms[pname].values())) == 1:
                    notes.append(f"- {p.id} {donor}->{recip} {pname}: every import is byte-identical to the "
                                 f"recipient's KV (changed bytes {pr.imports[pname]['BOTH']['changed_bytes']}): "
                                 "all four arms are one trajectory")
            say(f"frontier panels {p.id} {donor}->{recip}: {len(pr.runs)} runs")
    ds = F.canonicalise(F.combine(datasets), reference_direction=f"{directions[0][0]}->{directions[0][1]}")
    if results_path is not None:
        F.save_results(ds, results_path)
    toks = {}

    def piece(task, tok):
        if tok not in toks:
            toks[tok] = model.detokenize([tok])
        return toks[tok]

    head = (f"## Frontier panels ({', '.join(panels)}; arms {', '.join(dict.fromkeys(x for d in directions for x in d))}, "
            f"cap {cap}, "
            f"{time.perf_counter() - t0:.0f} s)\n\n"
            "Four subset crosses per panel through the common receiver (EMPTY, component 1, component 2, both), "
            "full FP32 logits.  One in-process repeat per direction; `statelab frontier run` repeats each panel "
            "in independent processes and stores the traces.\n\n")
    body = summary_markdown(ds, None, piece)
    return head + body + ("\n" + "\n".join(notes) + "\n" if notes else "")

