"""Speculative campaigns: qualification against R, complete request times in fresh worker
processes, counterbalanced blocks, session-level log contrasts with a percentile bootstrap
(paper 4.2, S3.1), and the phase-mask experiment (paper 3.5, S1.2)."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from statelab import prompts
from statelab.analysis.classes import bootstrap_ratio_interval, first_difference
from statelab.runtime.admission import device_refusal
from statelab.errors import ConfigError, StatelabError
from statelab.experiments.executors import Unit, execute
from statelab.experiments.matrix.store import CellLog, first_ok
from statelab.experiments.records import CAMPAIGN_BLOCK
from statelab.experiments.specfile import check_keys, read_toml
from statelab.models import model_sha256, resolve_model
from statelab.paths import atomic_write_netcdf, atomic_write_text, exclusive_lock
from statelab.runtime import Model, prepare_backend
from statelab.runtime.layouts import Layout
from statelab.speculative import drafters
from statelab.speculative.transaction import (
    Arm,
    Runner,
    SpecConfig,
    VerifyCosts,
    check_mask,
    qualify,
)

DEFAULT_RATIOS = (("C_PQ", "C_QB"), ("C_GS", "C_QB"), ("C_QB", "M0"), ("R", "C_QB"))


@dataclass
class CampaignSpec:
    prompts: list[str]
    arms: list[str]
    sessions: int = 2
    repeats: int = 1  # requests per (session, prompt, arm) block
    k: int = 3
    ubatch: int = 0  # 0: follows k (k_max + 1 rows per micrograph)
    mask: int = 3
    cap: int = 64
    n_ctx: int = 1024  # the contexts' size: every prompt + cap + verify rows must fit (checked at load)
    backend: str = "cpu"
    threads: int = 0
    model: str | None = None
    draft: str | None = "self"  # a drafter text (speculative.drafters.KINDS), e.g. "ngram:1-8+session"
    k_max: int | None = None  # adaptive k within [1, k_max]
    fixed_rows: bool = False  # every verify submits k_max + 1 rows (one graph shape)
    gate: bool = False  # propose only when the expected gain is positive (verify costs calibrated per session)
    groups: dict = field(default_factory=dict)  # tag -> prompt specs (default: HumanEval code, chat prose)
    ratios: list[list[str]] = field(default_factory=lambda: [list(r) for r in DEFAULT_RATIOS])
    threshold: float = 1.02
    seed: int = 20261014
    resamples: int = 10000

    @classmethod
    def load(cls, path: str | Path, check_fit: bool = True, **overrides) -> "CampaignSpec":
        """Read a spec; keyword overrides that are not None replace its values. ``check_fit``:
        tokenize the prompts with the spec's model and refuse one that does not fit n_ctx
        (before any work)."""
        p = Path(path)
        raw = read_toml(p, "campaign spec", ConfigError)
        raw = raw.get("campaign", raw)
        check_keys(raw, p, "campaign spec", ConfigError, tuple(cls.__dataclass_fields__), ())
        if isinstance(raw.get("prompts"), list):  # file: and chat: paths relative to the spec file where they exist
            raw["prompts"] = [near_spec(x, p) for x in raw["prompts"]]
        if isinstance(raw.get("groups"), dict):
            raw["groups"] = {t: [near_spec(x, p) for x in v] if isinstance(v, list) else v
                             for t, v in raw["groups"].items()}
        spec = cls(**{**raw, **{k: v for k, v in overrides.items() if v is not None}})
        spec.validate()
        if check_fit:
            spec.check_fits(p)
        return spec

    def check_fits(self, path="campaign spec") -> None:
        """Every prompt, with the cap and a verify's rows (drafting arms), fits n_ctx: the check
        the first request of a block would otherwise make, as a one-line refusal at load."""
        margin = self.spec_config().rows if any(Arm.parse(a).draft for a in self.arms) else 0
        model = _vocab_model(self.model, self.backend)
        for spec_text in self.prompts:
            p = prompts.resolve(spec_text, self.model, self.backend)
            n = len(model.tokenize(p.text))
            if n + self.cap + margin > self.n_ctx:
                raise ConfigError(f"campaign spec {path}: prompt {p.id} ({n} tokens) + cap ({self.cap}) + verify rows "
                                  f"({margin}) exceed n_ctx={self.n_ctx}; raise n_ctx or lower cap")

    def validate(self) -> None:

        types = {"prompts": list, "arms": list, "sessions": int, "repeats": int, "k": int, "ubatch": int, "mask": int,
                 "cap": int, "n_ctx": int, "backend": str, "threads": int, "model": (str, type(None)),
                 "draft": (str, type(None)), "k_max": (int, type(None)), "fixed_rows": bool, "gate": bool,
                 "groups": dict, "ratios": list,
                 "threshold": (int, float), "seed": int, "resamples": int}
        for name, want in types.items():
            v = getattr(self, name)
            if not isinstance(v, want) or (isinstance(v, bool) and want is int):
                raise ConfigError(f"campaign spec: {name} = {v!r} has the wrong type")
        for a in self.arms:
            Arm.parse(a)
        if "R" not in self.arms:
            raise ConfigError("a campaign needs the reference arm R for qualification")
        seen: dict[str, str] = {}
        for p in self.prompts:
            key = prompt_key(prompts.resolve(p, self.model, self.backend))
            if key in seen:
                raise ConfigError(f"prompts {seen[key]!r} and {p!r} are the same prompt ({key})")
            seen[key] = p
        drafters.check(self.draft)
        for tag, ps in self.groups.items():
            if not isinstance(ps, list) or any(p not in self.prompts for p in ps):
                raise ConfigError(f"campaign spec: group {tag!r} must list prompts of the spec, got {ps!r}")
        self.spec_config()  # its checks (k, ubatch, mask, cap)
        if self.sessions < 1 or self.repeats < 1:
            raise ConfigError("sessions and repeats must be >= 1")
        if drafters.check(self.draft) is None and any(Arm.parse(a).draft for a in self.arms):
            raise ConfigError(f"arms {[a for a in self.arms if Arm.parse(a).draft]} draft, but the spec names no drafter")

    def spec_config(self) -> SpecConfig:
        return SpecConfig(k=self.k, ubatch=self.ubatch, mask=self.mask, cap=self.cap, n_ctx=self.n_ctx,
                          backend=self.backend,
                          threads=self.threads, k_max=self.k_max, fixed_rows=self.fixed_rows)

    def prompt_table(self) -> list[tuple[str, str]]:
        """(spec string, prompt key) in the spec's order."""

        return [(p, prompt_key(prompts.resolve(p, self.model, self.backend))) for p in self.prompts]


_VOCAB: dict = {}


def _vocab_model(model_path, backend: str):
    """The spec's model, loaded once per process, for tokenizing its prompts at load."""
    key = (str(model_path), backend)
    if key not in _VOCAB:
        prepare_backend(backend)
        _VOCAB[key] = Model(model_path, backend=backend)
    return _VOCAB[key]


def near_spec(prompt_spec, spec_path: Path):
    """A ``file:``/``chat:`` prompt with a relative path that exists next to the spec file ->
    that path; anything else as it is (relative to the working folder)."""
    if not isinstance(prompt_spec, str):
        return prompt_spec
    kind, _, rest = prompt_spec.partition(":")
    if kind in ("file", "chat") and rest and not Path(rest).is_absolute() and (spec_path.parent / rest).is_file():
        return f"{kind}:{spec_path.parent / rest}"
    return prompt_spec


def prompt_key(prompt) -> str:
    """How campaigns identify a prompt: its id and the first 12 hex digits of its text's sha256
    (a Prompt, or a record with 'prompt' and 'prompt_sha256')."""
    if isinstance(prompt, dict):
        return f"{prompt['prompt']}@{prompt['prompt_sha256'][:12]}"
    return f"{prompt.id}@{prompt.sha256[:12]}"


def resolve_draft(target_path, draft: str | None, cache_dir: Path | None = None) -> str | None:
    """The resolved text of a drafter (:func:`statelab.speculative.drafters.resolve`): what a
    worker process resolves again without deriving anything; None for no drafter."""
    d = drafters.resolve(draft, target_path, cache_dir)
    return None if d is None else d.text


def load_runner(model_path, draft: str | None, cfg: SpecConfig, costs: dict | None = None) -> Runner:
    """The target (and the draft model a model drafter needs) loaded for ``cfg``'s backend."""
    prepare_backend(cfg.backend)
    tm = Model(model_path, backend=cfg.backend)
    d = drafters.resolve(draft, tm.path) if draft else None  # a foreign vocabulary is refused by its header
    dm = None
    if d is not None and d.needs_model:
        dm = tm if d.path is None else Model(d.path, backend=cfg.backend)
    return Runner(tm, dm, cfg, vocab_checked=True, draft=d, costs=costs)


def run_arms(model_path, draft, prompt, names: list[str], cfg: SpecConfig, refused=lambda arm, why: None,
             gate: bool = False):
    """Arms on one prompt in this process (``spec run``), R first (every arm is qualified
    against it, so R runs even when not named); an arm the device would not run
    (:func:`~statelab.runtime.admission.device_refusal`) is reported to ``refused(arm, why)``
    and left out.  With ``gate`` each drafting arm's verify costs are measured first (on
    ``prompt``) and its proposals gated by them.  Returns (qualified results, whether a
    drafter was needed)."""
    need_draft = any([Arm.parse(a).draft for a in names])  # a list: every name is checked
    runner = load_runner(model_path, resolve_draft(model_path, draft) if need_draft else None, cfg)
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
    return qualify([runner.run(a, prompt, warmup=True) for a in kept]), need_draft


def _worker(job: dict) -> dict:
    """One fresh process: load, then either the gate's calibration (``job["calibrate"]``) or
    one registered warmup and the block's requests, its session drafter holding the
    session's earlier outputs (``job["session_outputs"]``)."""

    cfg = SpecConfig(**job["cfg"])
    costs = {job["arm"]: VerifyCosts.from_dict(job["costs"])} if job.get("costs") else None
    runner = load_runner(job["model"], job["draft"], cfg, costs)
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


BLOCK = Unit("statelab.experiments.campaign:block_result", block_failed)  # how the executors run a block


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


def plan(spec: CampaignSpec, draft: str | None) -> list[dict]:
    """Counterbalanced blocks: the arm order reverses in alternate sessions and prompts.  With
    the gate, each session starts with one calibration block per drafting arm (its verify
    costs on this device, in a fresh process like every block)."""
    jobs: list[dict] = []
    cfg = asdict(spec.spec_config())

    def add(**job) -> None:
        jobs.append({"block": len(jobs), "repeats": spec.repeats, "cfg": cfg, "model": spec.model, **job})

    for s in range(spec.sessions):
        if spec.gate:
            for arm in spec.arms:
                if Arm.parse(arm).draft:
                    add(session=s, prompt=spec.prompts[0], arm=arm, draft=draft, calibrate=True, prompt_index=-1)
        for pi, p in enumerate(spec.prompts):
            order = list(spec.arms) if (s + pi) % 2 == 0 else list(reversed(spec.arms))
            for arm in order:
                add(session=s, prompt=p, arm=arm, draft=draft if Arm.parse(arm).draft else None, prompt_index=pi)
    return jobs


def feed(jobs: list[dict], done: dict[str, dict], session: bool) -> None:
    """Give each drafting block what its session has produced so far (from the finished
    blocks ``done``, keyed ``block-N``): the calibrated verify costs of its arm (``costs``) and,
    for a session drafter, its arm's outputs of the session's earlier prompts in the order the
    session ran them (``session_outputs``).  Blocks run one at a time in plan order, so a
    block's inputs are complete when it starts (and again when a campaign resumes)."""
    costs: dict[tuple, dict] = {}
    outs: dict[tuple, list] = {}
    for j in jobs:
        e = done.get(f"block-{j['block']}")
        if e is None or not j.get("draft"):
            continue
        if j.get("calibrate"):
            costs[(j["session"], j["arm"])] = e["costs"]
        elif e["records"]:
            outs.setdefault((j["session"], j["arm"]), []).append((j["prompt_index"], e["records"][0]["tokens"]))
    for j in jobs:
        if not j.get("draft") or j.get("calibrate"):
            continue
        key = (j["session"], j["arm"])
        j["costs"] = costs.get(key)
        if session:
            j["session_outputs"] = [t for pi, t in sorted(outs.get(key, []), key=lambda x: x[0])
                                    if pi < j["prompt_index"]]


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


def contrasts(records: list[dict], ratios, threshold: float, seed: int, resamples: int) -> list[dict]:
    """Ratio num/den of complete request times per pair, qualified arms only: per session,
    the mean over prompts of log(mean time num / mean time den); a percentile bootstrap over
    sessions; no trimming."""

    out = []
    for num, den in ratios:
        arms_q = {a: all(r["qualified"] for r in records if r["arm"] == a) and any(r["arm"] == a for r in records)
                  for a in (num, den)}
        row = {"ratio": f"{num}/{den}", "qualified": bool(arms_q[num] and arms_q[den])}
        if not row["qualified"]:
            bad = [a for a, ok in arms_q.items() if not ok]
            row["note"] = f"not compared: {', '.join(bad)} not qualified against R (or absent)"
            out.append(row)
            continue
        sessions = sorted({r["session"] for r in records})
        logs = []
        for s in sessions:
            per_prompt = []
            for p in sorted({r["key"] for r in records}):
                t = {a: [r["seconds"] for r in records if r["session"] == s and r["key"] == p and r["arm"] == a]
                     for a in (num, den)}
                if t[num] and t[den]:
                    per_prompt.append(np.log(np.mean(t[num]) / np.mean(t[den])))
            logs.append(float(np.mean(per_prompt)))
        bi = bootstrap_ratio_interval(logs, n_resamples=resamples, seed=seed)
        row.update(estimate=float(bi.ratio), lower=float(bi.lower), upper=float(bi.upper), sessions=len(logs),
                   session_log_contrasts=logs, above_threshold=bool(bi.lower > threshold), seed=seed)
        out.append(row)
    return out


COUNTERS = ("proposals", "accepted", "declined", "rollbacks", "cycles", "target_callers", "target_micrographs", "verify_calls",
            "verify_rows", "committed", "graph_builds", "graph_reuses", "length")
TIMES = ("t_cycle", "t_draft", "t_verify", "t_sample", "t_rollback")


def to_dataset(records: list[dict]):
    import xarray as xr

    keys = sorted({(r["session"], r["key"], r["arm"], r["request"]) for r in records})
    sessions = sorted({k[0] for k in keys})
    prompts_ = sorted({k[1] for k in keys})
    arms = sorted({k[2] for k in keys})
    reqs = sorted({k[3] for k in keys})
    shape = (len(sessions), len(prompts_), len(arms), len(reqs))
    seconds = np.full(shape, np.nan)
    qualified = np.zeros(shape, dtype=np.int8) - 1
    counters = {c: np.full(shape, -1, dtype=np.int64) for c in COUNTERS}
    times = {c: np.full(shape, np.nan) for c in TIMES}
    sha = {r["key"]: r["prompt_sha256"] for r in records}
    for r in records:
        i = (sessions.index(r["session"]), prompts_.index(r["key"]), arms.index(r["arm"]), reqs.index(r["request"]))
        seconds[i] = r["seconds"]
        qualified[i] = -1 if r["qualified"] is None else int(r["qualified"])
        for c in counters:
            counters[c][i] = r.get(c, -1)
        for c in times:
            times[c][i] = r.get(c, np.nan)
    dims = ("session", "prompt", "arm", "request")
    return xr.Dataset({"seconds": (dims, seconds), "qualified": (dims, qualified),
                       **{c: (dims, v) for c, v in counters.items()}, **{c: (dims, v) for c, v in times.items()}},
                      coords={"session": sessions, "prompt": prompts_, "arm": arms, "request": reqs,
                              "prompt_sha256": ("prompt", [sha[p] for p in prompts_])})


def drafter_summary(records: list[dict], arm: str) -> dict:
    """Totals of one drafting arm over its records: committed tokens per target verify call,
    acceptance, micrographs per committed token, and the shares of the continuation's time."""
    rs = [r for r in records if r["arm"] == arm]
    tot = {c: sum(r.get(c, 0) for r in rs) for c in COUNTERS + TIMES}
    cyc = tot["t_cycle"] or float("nan")
    parts = {c: tot[c] / cyc for c in TIMES[1:]}
    parts["python"] = 1.0 - sum(parts.values())
    return {"arm": arm, "requests": len(rs), "tokens_per_call": tot["committed"] / max(tot["verify_calls"], 1),
            "acceptance": tot["accepted"] / max(tot["proposals"], 1),
            "rows_per_call": tot["verify_rows"] / max(tot["verify_calls"], 1),
            "micrographs_per_token": tot["target_micrographs"] / max(tot["committed"], 1),
            "graph_reuse": (tot["graph_reuses"] / max(tot["graph_builds"] + tot["graph_reuses"], 1)
                            if all(r.get("graph_builds", -1) >= 0 for r in rs) else float("nan")),
            "ms_per_cycle": 1e3 * tot["t_cycle"] / max(tot["verify_calls"], 1), "shares": parts, **tot}


def prompt_tags(spec: CampaignSpec) -> dict[str, str]:
    """prompt key -> its group: the spec's ``groups`` where given, else code (HumanEval), prose
    (chat:) or other."""
    tag_of = {p: t for t, ps in spec.groups.items() for p in ps}
    out = {}
    for p, key in spec.prompt_table():
        out[key] = tag_of.get(p) or ("code" if key.startswith("HumanEval/") else
                                     "prose" if key.startswith("chat:") else "other")
    return out


def breakdown(spec: CampaignSpec, records: list[dict], rows: list[dict]) -> list[dict]:
    """Every qualified ratio per group of prompts and per prompt, each with its own bootstrap
    over sessions (the same estimator as the whole panel's)."""
    tags = prompt_tags(spec)
    out = []
    for row in rows:
        if not row["qualified"]:
            continue
        pair = [row["ratio"].split("/")]
        scopes = [("group", t, [k for k, tt in tags.items() if tt == t]) for t in dict.fromkeys(tags.values())]
        scopes += [("prompt", k, [k]) for k in tags]
        for kind, name, keys in scopes:
            rs = [r for r in records if r["key"] in keys]
            c = contrasts(rs, pair, spec.threshold, spec.seed, spec.resamples)[0]
            out.append({"ratio": row["ratio"], "scope": kind, "name": name, "tag": tags[name] if kind == "prompt"
                        else name, "prompts": len(keys), **{k: c.get(k) for k in ("estimate", "lower", "upper")}})
    return out


def breakdown_markdown(parts: list[dict]) -> list[str]:
    if not parts:
        return []
    lines = ["## Ratios by group and by prompt (qualified arms only)\n",
             "Each with its own percentile bootstrap over sessions (same estimator as the panel's).\n",
             "| ratio | scope | group | prompt | estimate | 95% interval |", "|---|---|---|---|---|---|"]
    for p in parts:
        est = "—" if p["estimate"] is None else f"{p['estimate']:.3f}"
        iv = "—" if p["lower"] is None else f"[{p['lower']:.3f}, {p['upper']:.3f}]"
        lines.append(f"| {p['ratio']} | {p['scope']} | {p['tag']} | {p['name'] if p['scope'] == 'prompt' else '-'} | "
                     f"{est} | {iv} |")
    for ratio in dict.fromkeys(p["ratio"] for p in parts):
        per = [p for p in parts if p["ratio"] == ratio and p["scope"] == "prompt" and p["estimate"] is not None]
        if per:
            low = min(per, key=lambda p: p["estimate"])
            lines.append(f"\n{ratio}: lowest prompt {low['name']} at {low['estimate']:.3f}; "
                         f"{sum(p['estimate'] < 1.0 for p in per)} of {len(per)} prompts below 1.0.")
    return lines + [""]


def costs_markdown(costs: dict[str, dict]) -> list[str]:
    if not costs:
        return []
    n = max(len(c["same"]) for c in costs.values())
    lines = ["## Gate calibration: verify call by rows (ms, same shape / shape changed)\n",
             "| arm, session | " + " | ".join(str(r) for r in range(1, n + 1)) + " |", "|---|" + "---|" * n]
    for name, c in costs.items():
        lines.append(f"| {name} | " + " | ".join(f"{1e3 * a:.2f} / {1e3 * b:.2f}" for a, b in zip(c["same"], c["change"]))
                     + " |")
    return lines + [""]


def report_markdown(spec: CampaignSpec, records: list[dict], rows: list[dict], parts: list[dict] | None = None,
                    costs: dict | None = None) -> str:
    lines = ["# Speculative campaign\n",
             f"k={spec.k}{f' (adaptive, k_max {spec.k_max})' if spec.k_max else ''}, "
             f"target ubatch {spec.spec_config().target_ubatch}, "
             f"{'fixed-shape verify, ' if spec.fixed_rows else ''}phase mask {spec.mask}, cap {spec.cap}, "
             f"backend {spec.backend}, draft {spec.draft}{', gated by calibrated verify costs' if spec.gate else ''}, "
             f"{spec.sessions} sessions x {spec.repeats} requests per "
             f"block, bootstrap {spec.resamples} resamples, seed {spec.seed}, threshold {spec.threshold}\n",
             "## Qualification against R\n",
             "Prompts are identified by id and the first 12 hex digits of their text's sha256.\n",
             "| arm | prompt | sha256 | qualified | first diff | median s | accepted/proposals | tokens/call |",
             "|---|---|---|---|---|---|---|---|"]
    table = spec.prompt_table()
    for a in spec.arms:
        for _spec_str, key in table:
            rs = [r for r in records if r["arm"] == a and r["key"] == key]
            if not rs:
                continue
            pid, sha = key.rsplit("@", 1)
            q = all(r["qualified"] for r in rs)
            fd = rs[0]["first_diff"]
            acc = f"{sum(r['accepted'] for r in rs)}/{sum(r['proposals'] for r in rs)}"
            tpc = sum(r.get("committed", 0) for r in rs) / max(sum(r.get("verify_calls", 0) for r in rs), 1)
            med = float(np.median([r["seconds"] for r in rs]))
            lines.append(f"| {a} | {pid} | {sha} | {'yes' if q else 'NO'} | {'=' if fd is None else fd} | "
                         f"{med:.3f} | {acc} | {tpc:.2f} |")
    n_q = {a: sum(all(r["qualified"] for r in records if r["arm"] == a and r["key"] == k) for _s, k in table)
           for a in spec.arms}
    lines += ["", "Qualified prompts per arm: " + ", ".join(f"{a} {n_q[a]}/{len(table)}" for a in spec.arms), ""]
    drafting = [a for a in spec.arms if Arm.parse(a).draft]
    if drafting:
        lines += ["## Drafting arms: cycles\n",
                  "Committed tokens per target verify call, acceptance (accepted / proposed), rows per verify "
                  "call, target micrographs per committed token (prefill included), the share of the "
                  "continuation's target graphs that llama.cpp reused instead of building, and where a cycle's "
                  "time goes (shares of the continuation's wall time; python = the rest: loop, bookkeeping, "
                  "counters).\n",
                  "| arm | tokens/call | acceptance | rows/call | micrographs/token | graphs reused | ms/cycle | draft "
                  "| verify decode | sampling | rollback | python |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for a in drafting:
            d = drafter_summary(records, a)
            sh = d["shares"]
            lines.append(f"| {a} | {d['tokens_per_call']:.3f} | {d['acceptance']:.3f} | {d['rows_per_call']:.2f} | "
                         f"{d['micrographs_per_token']:.3f} | {d['graph_reuse']:.1%} | {d['ms_per_cycle']:.3f} | "
                         f"{sh['t_draft']:.1%} | "
                         f"{sh['t_verify']:.1%} | {sh['t_sample']:.1%} | {sh['t_rollback']:.1%} | {sh['python']:.1%} |")
        lines.append("")
    lines += ["## Request-time ratios (qualified arms only)\n",
              "| ratio | estimate | 95% interval | > threshold | note |", "|---|---|---|---|---|"]
    for r in rows:
        if r["qualified"]:
            lines.append(f"| {r['ratio']} | {r['estimate']:.6f} | [{r['lower']:.6f}, {r['upper']:.6f}] | "
                         f"{'yes' if r['above_threshold'] else 'no'} | {r['sessions']} sessions |")
        else:
            lines.append(f"| {r['ratio']} | — | — | — | {r['note']} |")
    lines += [""] + breakdown_markdown(parts or []) + costs_markdown(costs or {})
    return "\n".join(lines) + "\n"


ANALYSIS_FIELDS = ("ratios", "threshold", "seed", "resamples", "groups")  # change the report, not a block
LATER_FIELDS = {"gate": False, "n_ctx": 1024}  # fields added later: at their default they leave older campaigns' hashes as they were


def campaign_hash(spec: CampaignSpec, draft: str | None) -> str:
    """Identity of what a campaign's blocks measured: the spec's block fields, every prompt's id
    and text hash, the target model's sha256 and the resolved drafter (analysis-only fields may
    change between runs of one folder)."""


    fields = {k: v for k, v in asdict(spec).items()
              if k not in ANALYSIS_FIELDS and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
    fields["prompts"] = [key for _, key in spec.prompt_table()]
    fields["model"] = model_sha256(resolve_model(spec.model))
    return hashlib.sha256(json.dumps([fields, draft], sort_keys=True).encode()).hexdigest()


def run_campaign(spec: CampaignSpec, out: Path, progress=None, budget_s: float | None = None) -> dict:
    """Run (or resume) a campaign in `out`: every finished block is appended to
    out/blocks.jsonl (flushed, fsynced) and skipped when the same campaign is run again in
    the same folder; with budget_s, no new block starts after that many seconds and the
    result says `complete: False` (run again to continue).  Reports are written once every
    block has run."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out / ".lock", ConfigError, f"campaign folder {out}", remove="created"):  # one writer: timings never overlap
        return _run_campaign_locked(spec, out, progress, budget_s)


def refused_arms(spec: CampaignSpec) -> dict[str, str]:
    """Arms whose layout the target device would not run (its supports_op rejects the attention
    products, which the scheduler would then run on the CPU): arm -> reason. Empty on the CPU."""
    if not any(Layout(Arm.parse(a).layout).device_must_admit(spec.backend) for a in spec.arms):
        return {}
    with Model(spec.model, backend=spec.backend) as m:
        q = spec.spec_config().queries
        why = {a: device_refusal(m, Arm.parse(a).layout, q) for a in spec.arms}
    return {a: w for a, w in why.items() if w}


def _run_campaign_locked(spec: CampaignSpec, out: Path, progress, budget_s: float | None) -> dict:
    refused = refused_arms(spec)
    if refused:
        raise ConfigError("; ".join(f"{a}: {w}" for a, w in refused.items()) + ": drop these arms from the campaign")
    draft = resolve_draft(spec.model, spec.draft) if any(Arm.parse(a).draft for a in spec.arms) else None
    jobs = plan(spec, draft)
    h = campaign_hash(spec, draft)
    log = CellLog(out / "blocks.jsonl", CAMPAIGN_BLOCK, error=ConfigError)
    old = log.records()
    if any(r.get("spec_hash") != h for r in old):
        raise ConfigError(f"{out} holds blocks of another campaign (spec or drafter changed); name a new --out")
    done = first_ok(old, h)
    session = draft is not None and draft.endswith("+session")
    feed(jobs, done, session)
    todo = [j for j in jobs if f"block-{j['block']}" not in done]

    def on_block(job: dict, res: dict) -> None:
        entry = {"key": f"block-{job['block']}", "status": "ok", "spec_hash": h, "records": res["records"],
                 **({"costs": res["costs"]} if "costs" in res else {})}
        log.append(entry)
        done[entry["key"]] = entry
        feed(jobs, done, session)  # the next blocks of the session hear this one (serial: before they start)

    t0 = time.monotonic()
    run_requests(todo, progress, stop=(lambda: time.monotonic() - t0 > budget_s) if budget_s is not None else None,
                 on_block=on_block)
    done = first_ok(log.records(), h)
    if len(done) < len(jobs):
        return {"complete": False, "blocks_done": len(done), "blocks": len(jobs)}
    return compile_campaign(spec, out, jobs, done)


def compile_campaign(spec: CampaignSpec, out: Path, jobs: list[dict], done: dict[str, dict]) -> dict:
    """Every block's records -> qualification, contrasts, results.nc, records.json,
    contrasts.json and report.md."""
    records = qualify_records([r for j in jobs for r in done[f"block-{j['block']}"]["records"]])
    costs = {f"{j['arm']} session {j['session']}": done[f"block-{j['block']}"]["costs"] for j in jobs
             if j.get("calibrate")}
    rows = contrasts(records, spec.ratios, spec.threshold, spec.seed, spec.resamples)
    ds = to_dataset(records)
    atomic_write_netcdf(out / "results.nc", ds)
    atomic_write_text(out / "records.json", json.dumps(records, indent=1))
    atomic_write_text(out / "contrasts.json", json.dumps(rows, indent=1))
    parts = breakdown(spec, records, rows)
    atomic_write_text(out / "breakdown.json", json.dumps({"ratios": parts, "costs": costs}, indent=1))
    md = report_markdown(spec, records, rows, parts, costs)
    atomic_write_text(out / "report.md", md)
    return {"complete": True, "records": records, "contrasts": rows, "breakdown": parts, "costs": costs, "report": md}


# -- phase-mask experiment -----------------------------------------------------------

def mask_lattice(passing: dict[int, bool]):
    """Subset lattice of the 4-bit masks (networkx DiGraph, edge a -> a|bit) and the
    inclusion-minimal passing masks (no passing proper subset)."""
    import networkx as nx

    g = nx.DiGraph()
    for m in range(16):
        g.add_node(m, passes=passing.get(m))
        for bit in (1, 2, 4, 8):
            if not m & bit:
                g.add_edge(m, m | bit)
    ok = {m for m, v in passing.items() if v}
    minimal = sorted(m for m in ok if not any(a in ok for a in nx.ancestors(g, m)))
    return g, minimal


def phase_mask_experiment(model_path, draft, prompts_: list[str], masks=range(16), repeats: int = 2, k: int = 3,
                          ubatch: int = 4, cap: int = 128, arm: str = "C_QB", backend: str = "cpu",
                          threads: int = 0, progress=None) -> dict:
    """Which masks reproduce R on every prompt and repeat; inclusion-minimal ones."""
    for m in masks:
        check_mask(m)
    jobs = []
    base = asdict(SpecConfig(k=k, ubatch=ubatch, mask=3, cap=cap, backend=backend, threads=threads))
    for p in prompts_:
        jobs.append({"session": 0, "block": len(jobs), "prompt": p, "arm": "R", "repeats": 1, "cfg": base,
                     "model": model_path, "draft": None, "mask": -1})
        for m in masks:
            for rep in range(repeats):
                jobs.append({"session": rep, "block": len(jobs), "prompt": p, "arm": arm, "repeats": 1,
                             "cfg": {**base, "mask": int(m)}, "model": model_path, "draft": draft, "mask": int(m)})
    records = run_requests(jobs, progress)
    for r in records:
        r["mask"] = jobs[r["block"]]["mask"]  # block = the job's index
    records = qualify_records(records)
    table = {}
    for m in masks:
        rs = [r for r in records if r.get("mask") == m]
        table[int(m)] = {p: bool(got) and all(got) for p in prompts_
                         for got in [[r["qualified"] for r in rs if r["spec"] == p]]}
    passing = {m: all(v.values()) for m, v in table.items()}
    _g, minimal = mask_lattice(passing)
    return {"table": table, "passing": passing, "minimal": minimal, "records": records}


def mask_markdown(res: dict, prompts_: list[str]) -> str:
    bits = lambda m: "".join(n if m & b else "-" for n, b in (("TP", 1), ("TC", 2), ("DP", 4), ("DC", 8)))
    lines = ["| mask | bits | " + " | ".join(prompts_) + " | all |", "|---|---|" + "---|" * (len(prompts_) + 1)]
    for m, row in sorted(res["table"].items()):
        lines.append(f"| {m} | {bits(m)} | " + " | ".join("Y" if row[p] else "n" for p in prompts_)
                     + f" | {'Y' if res['passing'][m] else 'n'} |")
    lines.append(f"\ninclusion-minimal passing masks: {res['minimal'] or 'none'}\n")
    return "\n".join(lines)


def write_masks(out, res: dict, md: str) -> None:
    """A phase-mask experiment into ``out``: ``masks.md`` and ``masks.json`` (records last)."""
    out = Path(out)
    atomic_write_text(out / "masks.md", md)
    atomic_write_text(out / "masks.json", json.dumps({k: v for k, v in res.items() if k != "records"}
                                                     | {"records": res["records"]}, indent=1, default=str))
