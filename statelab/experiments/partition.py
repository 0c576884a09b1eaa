"""Partition studies: natural endpoints of several schedules, shams, whole-KV crosses,
and partition sweeps with equivalence classes (paper 6.1, S4).

As a kind of the engine (:data:`PARTITION`, ``sweep`` and the demo's partition study) one
unit is one prompt in a fresh process: in the ``study`` mode its natural arms, shams and
whole-KV crosses (:func:`study_prompt`), in the ``sweep`` mode every schedule's endpoint and
state (:func:`sweep`); each unit's record is appended to ``OUT/units.jsonl`` and skipped when
the same spec runs again in the same folder."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from statelab import prompts as prompts_mod
from statelab.analysis.classes import endpoint_class, first_difference, kv_profile_dataset, trajectory_classes
from statelab.analysis.frontier import _top_two
from statelab.errors import ConfigError, StatelabError
from statelab.experiments import engine
from statelab.experiments.engine import Kind, Summary
from statelab.experiments.executors import Unit
from statelab.experiments.folder import RunFolder, normalized_hash
from statelab.experiments.log import CellLog
from statelab.experiments.records import PARTITION_UNIT
from statelab.experiments.spec_run import identity_fields
from statelab.kvstate import compare
from statelab.lab.formation import PRESETS, Schedule, paper_sweep, parse_schedule, partition_sweep, prefill
from statelab.lab.intervene import config_of, cross, natural, sham
from statelab.lab.receiver import DEFAULT_CAP, check_cap, continue_greedy
from statelab.paths import atomic_write_netcdf, atomic_write_text
from statelab.runtime import Context, ContextConfig, Model, prepare_backend


@dataclass
class PromptResult:
    prompt_id: str
    n_prompt: int
    captures: dict = field(default_factory=dict)  # arm -> Capture
    natural: dict = field(default_factory=dict)  # arm -> Endpoint
    sham: dict = field(default_factory=dict)  # arm -> Endpoint
    crosses: dict = field(default_factory=dict)  # (donor, recipient) -> (Endpoint, ImportAccount)
    margins: dict = field(default_factory=dict)  # arm -> top-1 margin per output (with trace=True)

    @property
    def controls_pass(self) -> bool:
        return all(self.sham[a].same(self.natural[a]) for a in self.sham)

    def rows(self) -> list[dict]:
        """One summary row per arm pair (first arm as reference)."""
        arms = list(self.natural)
        ref = arms[0]
        out = []
        for arm in arms[1:]:
            d = compare(self.captures[ref].state, self.captures[arm].state)
            row = {
                "prompt": self.prompt_id, "n_prompt": self.n_prompt, "pair": f"{ref}/{arm}",
                "logits_equal": self.captures[ref].logits.tobytes() == self.captures[arm].logits.tobytes(),
                "kv_equal": d.identical, "kv_max_abs": d.max_abs, "kv_l2_rel": d.l2_rel,
                "first_diff": first_difference(self.natural[ref].tokens, self.natural[arm].tokens),
                "shams_ok": self.controls_pass,
            }
            for (donor, recip), (ep, _acc) in self.crosses.items():
                if {donor, recip} == {ref, arm}:
                    row[f"cross {donor}->{recip}"] = cross_label(ep, self.natural[donor], self.natural[recip])
            out.append(row)
        return out


def cross_label(result, donor, recipient) -> str:
    return endpoint_class(result.tokens, donor.tokens, recipient.tokens)


def study_prompt(model, prompt, arms: dict[str, Schedule], base, cap: int = DEFAULT_CAP, crosses: bool = True,
                 progress=None, trace: bool = False) -> PromptResult:
    """Natural endpoints of every arm, own-path shams, and whole-KV crosses both ways
    between the first arm and each other arm (only when the shams pass).  With ``trace``
    the natural continuations keep each output's top-1 margin (the logits are dropped)."""
    res = PromptResult(prompt.id, 0)
    for name, sched in arms.items():
        cap_, ep = natural(model, prompt, sched, base, cap, trace=trace)
        if trace:
            res.margins[name] = _top_two(ep.trace)[2]
            ep.trace = None
        res.captures[name], res.natural[name] = cap_, ep
        res.n_prompt = cap_.n_prompt
        if progress:
            progress()
    for name in arms:
        res.sham[name] = sham(model, res.captures[name], cap)
        if progress:
            progress()
    if crosses and res.controls_pass:
        names = list(arms)
        for other in names[1:]:
            for donor, recip in ((names[0], other), (other, names[0])):
                res.crosses[(donor, recip)] = cross(model, res.captures[donor], res.captures[recip], cap=cap)
                if progress:
                    progress()
    return res


def sham_control(model, capture, cap: int = DEFAULT_CAP):
    """A capture's sham next to its natural endpoint, re-formed with the same schedule in a
    context of the capture's configuration: (sham endpoint, first differing output or None)."""
    imported = capture.identity.get("origin") == "imported"
    if imported:
        check_stated_formation(model, capture)
    s = sham(model, capture, cap, allow_other_backend=imported)
    with Context(model, config_of(capture)) as ctx:
        logits = prefill(ctx, capture.tokens, capture.schedule)
        nat = continue_greedy(ctx, logits, capture.n_prompt, cap)
    return s, first_difference(nat.tokens, s.tokens)


def check_stated_formation(model, capture) -> None:
    """An imported capture's natural path is its stated formation (``import-state --schedule``)
    re-run here; refuse in one line when none was stated, or when it forms another state (the
    state did not come from that formation on this backend: a sham would be no control)."""
    from statelab.errors import IdentityError
    from statelab.lab.archive import check_importable
    from statelab.lab.interop import IMPORTED

    sc = capture.schedule
    if sc.name == IMPORTED:
        raise IdentityError(f"sham cannot rebuild the natural path of {capture.prompt_id}: an imported state "
                            "records no formation (prompt submissions and ubatch); import it again with --schedule "
                            "to state one, or continue it with 'statelab continue'")
    config = config_of(capture)
    check_importable(capture, model, config, allow_other_backend=True)
    with Context(model, config) as ctx:
        prefill(ctx, capture.tokens, sc)
        formed = ctx.state_get()
    if formed != capture.blob:
        d = compare(capture.state, type(capture.state).parse(formed, capture.layout))
        raise IdentityError(f"sham cannot use schedule {sc.name} as the formation of {capture.prompt_id}: it forms "
                            f"another state here (first differing layer {d.first_differing_layer}), so the imported "
                            "state was not formed that way on this backend and its natural path is unknown")


def sweep_schedules(model, prompt, schedules: str | None = None) -> list[Schedule]:
    """The schedules of a partition sweep: a comma list, or by default A then the partition
    sweep of the prompt's length."""
    if schedules == "paper":
        return paper_sweep(len(model.tokenize(prompt.text)))
    if schedules:
        return [parse_schedule(s) for s in schedules.split(",")]
    return [PRESETS["A"]] + partition_sweep(len(model.tokenize(prompt.text)))


def sweep(model, prompt, schedules: list[Schedule], base, cap: int = DEFAULT_CAP, progress=None) -> dict:
    """Every schedule's endpoint, first difference from the first schedule, and equivalence
    classes of identical endpoints and of identical states (KV + logits)."""
    rows, endpoints, states = [], {}, {}
    ref = None
    for s in schedules:
        capture, ep = natural(model, prompt, s, base, cap)
        h = capture.hashes()
        endpoints[s.name] = (ep.tokens, ep.eog)
        states[s.name] = h["kv"] + h["logits"]  # a string: compared as itself
        if ref is None:
            ref = ep
        rows.append({"schedule": s.name, "describe": s.describe(), "n_prompt": capture.n_prompt,
                     "kv_sha256": h["kv"][:16], "logits_sha256": h["logits"][:16], "length": ep.length,
                     "first_diff": first_difference(ref.tokens, ep.tokens), "stop": ep.stop_reason})
        if progress:
            progress()
    return {"prompt": prompt.id, "rows": rows, "endpoint_classes": trajectory_classes(endpoints),
            "state_classes": trajectory_classes(states)}


def sweep_table(results: list[dict]) -> str:
    """Several prompts' sweeps (:func:`sweep`) as one Markdown table: per prompt its state and
    endpoint classes, and per schedule ``s/e`` (its state class / endpoint class, 0 = the
    first schedule's) with the first output that differs from the first schedule's; then the
    counts over prompts (every one with its denominator)."""
    if not results:
        return "(no prompts)\n"
    names = [r["schedule"] for r in results[0]["rows"]]

    def index(classes: list, name: str) -> int:
        return next(i for i, c in enumerate(classes) if name in c)

    head = "| prompt | tokens | state classes | endpoint classes | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (4 + len(names))]
    same_state_other_end = other_state_same_end = 0
    for r in results:
        own = [x["schedule"] for x in r["rows"]]
        if len(own) != len(names):
            raise ConfigError(f"{r['prompt']}: {len(own)} schedules, not the {len(names)} of {results[0]['prompt']}")
        first = own[0]
        st = {n: index(r["state_classes"], n) - index(r["state_classes"], first) for n in own}
        en = {n: index(r["endpoint_classes"], n) - index(r["endpoint_classes"], first) for n in own}
        # class labels in order of first appearance along the schedules: the first schedule's is 0
        s_ord = list(dict.fromkeys(index(r["state_classes"], x) for x in own))
        e_ord = list(dict.fromkeys(index(r["endpoint_classes"], x) for x in own))
        cells = []
        for row in r["rows"]:
            n = row["schedule"]
            s_cls = s_ord.index(index(r["state_classes"], n))
            e_cls = e_ord.index(index(r["endpoint_classes"], n))
            fd = "=" if row["first_diff"] is None else str(row["first_diff"])
            cells.append(f"{s_cls}/{e_cls} ({fd})")
            same_state_other_end += int(st[n] == 0 and en[n] != 0)
            other_state_same_end += int(st[n] != 0 and en[n] == 0)
        lines.append(f"| {r['prompt']} | {r['rows'][0]['n_prompt']} | {len(r['state_classes'])} | "
                     f"{len(r['endpoint_classes'])} | " + " | ".join(cells) + " |")
    n = len(results) * (len(names) - 1)
    multi_s = sum(1 for r in results if len(r["state_classes"]) > 1)
    multi_e = sum(1 for r in results if len(r["endpoint_classes"]) > 1)
    caps = sorted({x["length"] for r in results for x in r["rows"]})
    return ("\n".join(lines) + "\n\n"
            f"Cells: state class / endpoint class (0 = the class of {names[0]}, then numbered along the schedules) and, "
            f"in brackets, the first output that differs from {names[0]}'s endpoint (= none). Prompts with more than "
            f"one state class: {multi_s} / {len(results)}; with more than one endpoint class: {multi_e} / "
            f"{len(results)}. Of the {n} (prompt, schedule other than {names[0]}) pairs: {other_state_same_end} form "
            f"another state than {names[0]} and keep its endpoint; {same_state_other_end} form {names[0]}'s state "
            f"and end elsewhere (must be 0). Endpoint lengths: {', '.join(map(str, caps))}.\n")


def prompt_record(res: PromptResult) -> dict:
    """A partition study of one prompt (:func:`study_prompt` with ``trace``) as a JSON record:
    its rows, natural endpoints, top-1 margins, the first difference of the first two arms'
    endpoints and the per-layer K/V differences of their states (what :func:`partition_dataset`
    reads)."""
    arms = list(res.natural)
    other = arms[1] if len(arms) > 1 else arms[0]
    rec = {"prompt": res.prompt_id, "n_prompt": res.n_prompt, "rows": res.rows(),
           "natural": {a: ep.as_dict() for a, ep in res.natural.items()},
           "margins": {a: [float(x) for x in m] for a, m in res.margins.items()},
           "first_diff": first_difference(res.natural[arms[0]].tokens, res.natural[other].tokens),
           "profile": compare(res.captures[arms[0]].state, res.captures[other].state).records()}
    return _plain(rec)


def _plain(x):
    """``x`` as JSON holds it (numpy scalars as Python numbers)."""
    return json.loads(json.dumps(x, default=lambda v: v.item() if isinstance(v, np.generic) else str(v)))


def partition_dataset(records: list[dict], backend: str, cap: int):
    """The natural arms of a partition study (:func:`prompt_record` records) as an xarray
    Dataset: ``margin`` and ``token`` (task, arm, output; NaN / -1 past an endpoint),
    ``first_diff`` of the first two arms (task; -1 equal), and the per-layer K/V differences
    of their states (task, layer, component): ``changed_bytes``, ``max_abs``, ``l2``, ``l2_rel``."""
    import xarray as xr

    arms = list(records[0]["natural"])
    n_out = max(len(ep["tokens"]) for r in records for ep in r["natural"].values())
    margin = np.full((len(records), len(arms), n_out), np.nan)
    token = np.full((len(records), len(arms), n_out), -1, np.int32)
    first = np.full(len(records), -1, np.int64)
    for i, r in enumerate(records):
        if set(r["margins"]) != set(arms):
            raise ValueError("partition_dataset needs the margins of every arm (study_prompt(..., trace=True))")
        for j, a in enumerate(arms):
            margin[i, j, :len(r["margins"][a])] = r["margins"][a]
            token[i, j, :len(r["natural"][a]["tokens"])] = r["natural"][a]["tokens"]
        first[i] = -1 if r["first_diff"] is None else r["first_diff"]
    tasks = [r["prompt"] for r in records]
    ds = xr.Dataset({"margin": (("task", "arm", "output"), margin, {"description": "top-1 minus top-2 logit"}),
                     "token": (("task", "arm", "output"), token),
                     "first_diff": (("task",), first, {"description": "first differing output of the first two "
                                                       "arms' natural endpoints (-1 equal)"})},
                    coords={"task": tasks, "arm": arms, "output": np.arange(n_out)})
    profiles = [kv_profile_dataset(r["profile"]) for r in records]
    ds = ds.merge(xr.concat(profiles, dim="task").assign_coords(task=tasks))
    ds.attrs.update(backend=backend, cap=int(cap), pair=f"{arms[0]}/{arms[1] if len(arms) > 1 else arms[0]}")
    return ds


# -- the partition study and the partition sweep as a kind of the engine -----------------

SPEC_FORMAT = "statelab.partition-spec/1"  # OUT/spec.json of a partition folder
MODES = ("study", "sweep")


@dataclass
class PartitionSpec:
    """A partition study (``mode`` "study": ``arms`` name -> schedule, natural endpoints,
    shams and, with ``crosses``, whole-KV crosses both ways between the first arm and each
    other) or a partition sweep (``mode`` "sweep": ``schedules`` a comma list, "paper", or
    None for A then the partition sweep of each prompt's length) over ``prompts`` (prompt
    specs)."""
    prompts: list[str]
    mode: str = "study"
    arms: dict = field(default_factory=dict)  # name -> schedule text (study)
    schedules: str | None = None  # sweep
    cap: int = DEFAULT_CAP
    backend: str = "cpu"
    threads: int = 0
    n_ctx: int = 1024
    model: str | None = None
    crosses: bool = True

    def validate(self) -> "PartitionSpec":
        if self.mode not in MODES:
            raise ConfigError(f"partition mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.prompts:
            raise ConfigError("a partition run needs at least one prompt")
        check_cap(self.cap)
        self.config()  # backend, threads, n_ctx checked
        self.arms = {n: parse_schedule(s).name for n, s in self.arms.items()}
        if self.mode == "study" and not self.arms:
            raise ConfigError("a partition study needs at least one arm")
        if self.model is not None:
            self.model = str(self.model)
        if self.schedules is not None and not str(self.schedules).strip():
            self.schedules = None  # an empty list of schedules is the default sweep
        return self

    def config(self) -> ContextConfig:
        return ContextConfig(backend=self.backend, n_threads=self.threads, n_ctx=self.n_ctx)


def unit_result(task: dict) -> dict:
    """One prompt in this (fresh) process: the model loaded, then the study or the sweep."""
    try:
        spec = PartitionSpec(**task["spec"])
        prepare_backend(spec.backend)
        with Model(spec.model, backend=spec.backend) as model:
            p = prompts_mod.resolve(task["prompt"], spec.model, spec.backend)
            if spec.mode == "sweep":
                rec = _plain(sweep(model, p, sweep_schedules(model, p, spec.schedules), spec.config(), spec.cap))
            else:
                arms = {n: parse_schedule(s) for n, s in spec.arms.items()}
                rec = prompt_record(study_prompt(model, p, arms, spec.config(), spec.cap, spec.crosses, trace=True))
        # the result as JSON text: the log sorts its records' keys, the rows keep their column order
        return {"key": task["key"], "status": "ok", "spec_hash": task["spec_hash"], "prompt": rec["prompt"],
                "prompt_sha256": p.sha256, "result": json.dumps(rec)}  # the text as rendered here
    except StatelabError as e:
        return unit_failed(task, str(e))


def unit_failed(task: dict, error: str) -> dict:
    return {"key": task["key"], "status": "failed", "spec_hash": task["spec_hash"], "error": " ".join(str(error).split())}


def _folder(spec: PartitionSpec, out) -> RunFolder:
    if out is None:  # one folder per identity: the same command resumes, a changed build, model or prompt starts anew
        out = Path("runs") / spec.mode / normalized_hash(identity_fields(spec))[:12]
    return RunFolder(Path(out), SPEC_FORMAT, ConfigError, f"partition {spec.mode}")


def _identity(run) -> tuple[str, dict]:
    """What the units measure: the spec's fields, every prompt's id and text hash, the model's
    sha256; a sweep's schedules of every prompt are made (and checked) here, before any unit."""
    spec = run.spec
    ps = [prompts_mod.resolve(t, spec.model, spec.backend) for t in spec.prompts]
    if spec.mode == "sweep" and spec.schedules in (None, "paper"):  # the prompt's length decides
        prepare_backend(spec.backend)
        with Model(spec.model, backend=spec.backend) as m:
            for p in ps:
                sweep_schedules(m, p, spec.schedules)
    elif spec.mode == "sweep":
        sweep_schedules(None, None, spec.schedules)
    fields = identity_fields(spec, ps)
    h = normalized_hash(fields)
    tasks = [{"key": key, "prompt": t, "spec": asdict(spec), "spec_hash": h}
             for t, key in zip(spec.prompts, fields["prompts"])]
    if len({t["key"] for t in tasks}) < len(tasks):
        raise ConfigError("a prompt is named twice in the partition run")
    run.state.update(tasks=tasks, log=CellLog(run.out / "units.jsonl", PARTITION_UNIT, error=ConfigError))
    return h, {"format": SPEC_FORMAT, "spec_hash": h, "normalized": fields}


def _accept(run, res: dict) -> dict:
    if res.get("status") != "ok":  # a prompt the model cannot run: the run stops in one line
        raise ConfigError(f"{res['key']}: {res['error']}")
    run.state["log"].append(res)
    return res


def _compile(run) -> dict:
    spec = run.spec
    done = run.state["log"].done(run.spec_hash)
    records = [json.loads(done[t["key"]]["result"]) for t in run.state["tasks"]]
    if spec.mode == "sweep":
        atomic_write_text(run.out / "sweep.json", json.dumps(records, indent=2))
        md = sweep_table(records)
        atomic_write_text(run.out / "report.md", md)
        return {"records": records, "markdown": md, "report_path": run.out / "report.md",
                "results_path": run.out / "sweep.json"}
    rows = [row for r in records for row in r["rows"]]
    ds = partition_dataset(records, spec.backend, spec.cap)
    atomic_write_netcdf(run.out / "partition.nc", ds)
    md = markdown_table(rows)
    atomic_write_text(run.out / "report.md", md)
    return {"records": records, "rows": rows, "dataset": ds, "markdown": md, "report_path": run.out / "report.md",
            "results_path": run.out / "partition.nc"}


def cell_text(v) -> str:
    """A study row's value as shown in the console table and the report ("=": no difference)."""
    return "=" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell_text(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


PARTITION = Kind(
    "partition", "statelab.experiments.partition", ConfigError, load_spec=lambda spec: spec.validate(),
    folder=_folder, identity=_identity, plan=lambda run: (run.state["tasks"], []),
    done=lambda run: run.state["log"].done(run.spec_hash),
    unit=lambda run: Unit("statelab.experiments.partition:unit_result", unit_failed,
                          {"STATELAB_THREADS": str(run.spec.threads)} if run.spec.threads else {}),
    accept=_accept, compile=_compile)


def run_partition(spec: PartitionSpec, out=None, progress=None, workers: int = 1, executor: str = "local") -> Summary:
    """Run (or resume) a partition study or sweep in ``out`` (default ``runs/<mode>/<hash>``)
    through the engine, one prompt per fresh process; ``outputs``: the records, the report's
    Markdown and (study) its rows and Dataset, (sweep) the classes of every prompt."""
    return engine.run(PARTITION, spec.validate(), out, executor, workers, progress=progress)
