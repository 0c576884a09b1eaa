"""Speculative requests: the arms on one prompt in this process (``spec run``), and the
request block that campaigns and the phase-mask experiment run in fresh worker processes,
one at a time (paper 4.2, S3.1): load the target (and its drafter), run, qualify against R."""
from __future__ import annotations

from pathlib import Path

from statelab import prompts
from statelab.analysis.classes import first_difference
from statelab.runtime.admission import device_refusal
from statelab.errors import ConfigError, StatelabError
from statelab.experiments.executors import Unit, execute
from statelab.runtime import Model, prepare_backend
from statelab.speculative import drafters
from statelab.speculative.transaction import Arm, Runner, SpecConfig, VerifyCosts, qualify


def prompt_key(prompt) -> str:
    """How campaigns identify a prompt: its id and the first 12 hex digits of its identity (the
    text's sha256; a ``chat:`` prompt's message and template, see :mod:`statelab.prompts`), of
    a Prompt, or of a record with 'prompt' and 'prompt_sha256' (the rendered text's)."""
    if isinstance(prompt, dict):
        return f"{prompt['prompt']}@{prompt['prompt_sha256'][:12]}"
    return f"{prompt.id}@{prompt.identity[:12]}"


def identity_fields(spec, resolved=None) -> dict:
    """What a run of ``spec`` (a dataclass with ``prompts``, ``model`` and ``backend``) measures:
    its fields, every prompt's key (of ``resolved``, the spec's prompts resolved, where the caller
    has them), the model's sha256 and the installed build's key: a rebuilt library forms its
    states anew, so a run is not resumed from another build's records (cheap: no model loaded)."""
    from dataclasses import asdict

    from statelab.models import model_sha256, resolve_model
    from statelab.runtime.native import installed_build_key

    fields = asdict(spec)
    ps = resolved if resolved is not None else [prompts.resolve(t, spec.model, spec.backend) for t in spec.prompts]
    fields["prompts"] = [prompt_key(p) for p in ps]
    fields["model"] = model_sha256(resolve_model(spec.model))
    fields["build"] = installed_build_key()
    return fields


def resolve_draft(target_path, draft: str | None, cache_dir: Path | None = None) -> str | None:
    """The resolved text of a drafter (:func:`statelab.speculative.drafters.resolve`): what a
    worker process resolves again without deriving anything; None for no drafter."""
    d = drafters.resolve(draft, target_path, cache_dir)
    return None if d is None else d.text


def load_runner(model_path, draft: str | None, cfg: SpecConfig, costs: dict | None = None,
                gate: str | bool = "gain") -> Runner:
    """The target (and the draft model a model drafter needs) loaded for ``cfg``'s backend."""
    prepare_backend(cfg.backend)
    tm = Model(model_path, backend=cfg.backend)
    d = drafters.resolve(draft, tm.path) if draft else None  # a foreign vocabulary is refused by its header
    dm = None
    if d is not None and d.needs_model:
        dm = tm if d.path is None else Model(d.path, backend=cfg.backend)
    return Runner(tm, dm, cfg, vocab_checked=True, draft=d, costs=costs, gate=gate)


def run_arms(model_path, draft, prompt, names: list[str], cfg: SpecConfig, refused=lambda arm, why: None,
             gate: bool | str = False, warmup: bool = True):
    """Arms on one prompt in this process (``spec run``), R first (every arm is qualified
    against it, so R runs even when not named); an arm the device would not run
    (:func:`~statelab.runtime.admission.device_refusal`) is reported to ``refused(arm, why)``
    and left out.  With ``gate`` (a kind of :data:`~statelab.speculative.drafters.GATES`; True:
    "gain") each drafting arm's verify costs are measured first (on ``prompt``) and its
    proposals gated by them.  ``warmup``: a short request of each arm before
    the one timed (without it the times include first-use costs: graph and shader builds).
    Returns (qualified results, whether a drafter was needed)."""
    need_draft = any([Arm.parse(a).draft for a in names])  # a list: every name is checked
    runner = load_runner(model_path, resolve_draft(model_path, draft) if need_draft else None, cfg, gate=gate or "gain")
    names = (["R"] if "R" not in names else []) + list(names)
    kept = []
    for a in names:
        why = device_refusal(runner.tm, Arm.parse(a).layout, cfg.queries)
        if why:
            refused(a, why)
        else:
            kept.append(a)
    if gate:
        runner.costs = {a: runner.measure_verify_costs(a, prompt) for a in kept if Arm.parse(a).draft}
    return qualify([runner.run(a, prompt, warmup=warmup) for a in kept]), need_draft


def _worker(job: dict) -> dict:
    """One fresh process: load, then either the gate's calibration (``job["calibrate"]``) or
    one registered warmup and the block's requests, its session drafter holding the
    session's earlier outputs (``job["session_outputs"]``)."""

    cfg = SpecConfig(**job["cfg"])
    costs = {job["arm"]: VerifyCosts.from_dict(job["costs"])} if job.get("costs") else None
    runner = load_runner(job["model"], job["draft"], cfg, costs, gate=job.get("gate", True))
    p = prompts.resolve(job["prompt"], job["model"], cfg.backend)
    if job.get("calibrate"):
        return {"records": [], "costs": runner.measure_verify_costs(job["arm"], p).as_dict()}
    for out in job.get("session_outputs") or ():
        runner.drafter.remember(out)
    records = []
    for i in range(job["repeats"]):
        r = runner.run(job["arm"], p, warmup=(i == 0))
        rec = r.record()
        rec.update(session=job["session"], block=job["block"], request=i, spec=job["prompt"], key=prompt_key(p),
                   session_memory=len(job.get("session_outputs") or ()))
        records.append(rec)
    return {"records": records}


def block_result(job: dict) -> dict:
    """What a block's fresh process returns: ``{"block", "records": [...]}`` (a calibration:
    ``"costs"`` too) or ``{"block", "error"}``."""
    try:
        return {"block": job["block"], **_worker(job)}
    except StatelabError as e:
        return block_failed(job, str(e))


def block_failed(job: dict, error: str) -> dict:
    return {"block": job["block"], "error": " ".join(str(error).split())}


BLOCK = Unit("statelab.experiments.spec_run:block_result", block_failed)  # how the executors run a block


def run_requests(jobs: list[dict], progress=None, on_block=None, stop=None) -> list[dict]:
    """Run jobs in the serial mode of the engine's executors (one at a time, in order: timings
    never overlap), each in a fresh process forked from the pre-imported fork server (no
    model loaded before the fork; the child loads its own).  on_block(job, records) hears each
    finished block; stop() -> True ends the run early (after the first block: every run makes
    progress)."""
    out = []
    by_block = {j["block"]: j for j in jobs}

    def on_result(res: dict) -> None:
        job = by_block[res["block"]]
        if "error" in res:
            raise ConfigError(f"block {job['block']} ({job['arm']} on {job['prompt']}): {res['error']}")
        out.extend(res["records"])
        if on_block:
            on_block(job, res)
        if progress:
            progress()

    execute(jobs, BLOCK, "local", 1, on_result, stop=stop or (lambda: False))
    return out


def qualify_records(records: list[dict]) -> list[dict]:
    """Each record qualifies when its complete endpoint equals every R endpoint of its prompt
    (the same id and text sha256)."""

    refs: dict[str, list] = {}
    for r in records:
        r.setdefault("key", prompt_key(r))
        if r["arm"] == "R":
            refs.setdefault(r["key"], []).append((tuple(r["tokens"]), r["eog"]))
    for r in records:
        ref = refs.get(r["key"])
        if not ref:
            r["qualified"], r["first_diff"] = None, None
            continue
        r["qualified"] = all((tuple(r["tokens"]), r["eog"]) == x for x in ref)
        r["first_diff"] = first_difference(list(ref[0][0]), r["tokens"])
    return records
