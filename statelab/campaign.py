"""Speculative campaigns: qualification against R, complete request times in fresh worker
processes, counterbalanced blocks, session-level log contrasts with a percentile bootstrap
(paper 4.2, S3.1), and the phase-mask experiment (paper 3.5, S1.2)."""
from __future__ import annotations

import json
import tomllib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .paths import atomic_path, atomic_write_text
from .speculative import Arm, SpecConfig, check_mask

DEFAULT_RATIOS = (("C_PQ", "C_QB"), ("C_GS", "C_QB"), ("C_QB", "M0"), ("R", "C_QB"))


@dataclass
class CampaignSpec:
    prompts: list[str]
    arms: list[str]
    sessions: int = 2
    repeats: int = 1  # requests per (session, prompt, arm) block
    k: int = 3
    ubatch: int = 4
    mask: int = 3
    cap: int = 64
    backend: str = "cpu"
    threads: int = 0
    model: str | None = None
    draft: str | None = "self"  # "self", a GGUF path, or "derive:N" (first N layers of the target)
    ratios: list[list[str]] = field(default_factory=lambda: [list(r) for r in DEFAULT_RATIOS])
    threshold: float = 1.02
    seed: int = 20261014
    resamples: int = 10000

    @classmethod
    def load(cls, path: str | Path) -> "CampaignSpec":
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"campaign spec not found: {p}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: malformed TOML: {e}") from None
        raw = raw.get("campaign", raw)
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(raw) - known)
        if bad:
            raise ConfigError(f"{p}: unknown keys {bad}; known: {sorted(known)}")
        spec = cls(**raw)
        spec.validate()
        return spec

    def validate(self) -> None:
        from . import prompts

        for a in self.arms:
            Arm.parse(a)
        if "R" not in self.arms:
            raise ConfigError("a campaign needs the reference arm R for qualification")
        for p in self.prompts:
            prompts.resolve(p)
        self.spec_config()  # its checks (k, ubatch, mask, cap)
        if self.sessions < 1 or self.repeats < 1:
            raise ConfigError("sessions and repeats must be >= 1")

    def spec_config(self) -> SpecConfig:
        return SpecConfig(k=self.k, ubatch=self.ubatch, mask=self.mask, cap=self.cap, backend=self.backend,
                          threads=self.threads)


def resolve_draft(target_path, draft: str | None, cache_dir: Path | None = None):
    """'self' -> the target itself; 'derive:N' -> a cached first-N-layers copy; else a path."""
    if draft in (None, "", "none"):
        return None
    if draft == "self":
        return "self"
    if draft.startswith("derive:"):
        from .derive import derive_truncated
        from .models import model_sha256, resolve_model
        from .paths import cache_dir as default_cache

        arg = draft.split(":", 1)[1]
        if not arg.isdigit():
            raise ConfigError(f"draft {draft!r}: derive:N needs a layer count N, e.g. derive:8")
        n = int(arg)
        src = resolve_model(target_path)
        out = (cache_dir or default_cache()) / "drafts" / f"{model_sha256(src)[:16]}-first{n}.gguf"
        if not out.exists():
            derive_truncated(src, out, n)
        return str(out)
    return draft


def _load_runner(model_path, draft, cfg: SpecConfig):
    from .runtime import Model, prepare_backend
    from .speculative import Runner

    prepare_backend(cfg.backend)
    tm = Model(model_path, backend=cfg.backend)
    dm = None
    if draft == "self":
        dm = tm
    elif draft:
        from .speculative import check_draft_paths

        check_draft_paths(tm.path, draft)  # before loading: a foreign vocabulary is refused by its header
        dm = Model(draft, backend=cfg.backend)
    return Runner(tm, dm, cfg, vocab_checked=True)


def _worker(job: dict) -> list[dict]:
    """One fresh process: load, one registered warmup, then the block's requests."""
    from . import prompts

    cfg = SpecConfig(**job["cfg"])
    runner = _load_runner(job["model"], job["draft"], cfg)
    p = prompts.resolve(job["prompt"])
    out = []
    for i in range(job["repeats"]):
        r = runner.run(job["arm"], p, warmup=(i == 0))
        rec = r.record()
        rec.update(session=job["session"], block=job["block"], request=i)
        out.append(rec)
    return out


def run_requests(jobs: list[dict], progress=None) -> list[dict]:
    """Run jobs sequentially, each in a fresh spawned process (timings never overlap)."""
    out = []
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn"), max_tasks_per_child=1) as ex:
        for job in jobs:
            out += ex.submit(_worker, job).result()
            if progress:
                progress()
    return out


def plan(spec: CampaignSpec, draft: str | None) -> list[dict]:
    """Counterbalanced blocks: the arm order reverses in alternate sessions and prompts."""
    jobs, block = [], 0
    cfg = asdict(spec.spec_config())
    for s in range(spec.sessions):
        for pi, p in enumerate(spec.prompts):
            order = list(spec.arms) if (s + pi) % 2 == 0 else list(reversed(spec.arms))
            for arm in order:
                jobs.append({"session": s, "block": block, "prompt": p, "arm": arm, "repeats": spec.repeats,
                             "cfg": cfg, "model": spec.model, "draft": draft if Arm.parse(arm).draft else None})
                block += 1
    return jobs


def qualify_records(records: list[dict]) -> list[dict]:
    """Each record qualifies when its complete endpoint equals every R endpoint of its prompt."""
    from .analysis import first_difference

    refs: dict[str, list] = {}
    for r in records:
        if r["arm"] == "R":
            refs.setdefault(r["prompt"], []).append((tuple(r["tokens"]), r["eog"]))
    for r in records:
        ref = refs.get(r["prompt"])
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
    from .analysis import bootstrap_ratio_interval

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
            for p in sorted({r["prompt"] for r in records}):
                t = {a: [r["seconds"] for r in records if r["session"] == s and r["prompt"] == p and r["arm"] == a]
                     for a in (num, den)}
                if t[num] and t[den]:
                    per_prompt.append(np.log(np.mean(t[num]) / np.mean(t[den])))
            logs.append(float(np.mean(per_prompt)))
        bi = bootstrap_ratio_interval(logs, n_resamples=resamples, seed=seed)
        row.update(estimate=float(bi.ratio), lower=float(bi.lower), upper=float(bi.upper), sessions=len(logs),
                   session_log_contrasts=logs, above_threshold=bool(bi.lower > threshold), seed=seed)
        out.append(row)
    return out


def to_dataset(records: list[dict]):
    import xarray as xr

    keys = sorted({(r["session"], r["prompt"], r["arm"], r["request"]) for r in records})
    sessions = sorted({k[0] for k in keys})
    prompts_ = sorted({k[1] for k in keys})
    arms = sorted({k[2] for k in keys})
    reqs = sorted({k[3] for k in keys})
    shape = (len(sessions), len(prompts_), len(arms), len(reqs))
    seconds = np.full(shape, np.nan)
    qualified = np.zeros(shape, dtype=np.int8) - 1
    counters = {c: np.full(shape, -1, dtype=np.int64) for c in
                ("proposals", "accepted", "rollbacks", "target_callers", "target_micrographs", "length")}
    for r in records:
        i = (sessions.index(r["session"]), prompts_.index(r["prompt"]), arms.index(r["arm"]), reqs.index(r["request"]))
        seconds[i] = r["seconds"]
        qualified[i] = -1 if r["qualified"] is None else int(r["qualified"])
        for c in counters:
            counters[c][i] = r[c]
    dims = ("session", "prompt", "arm", "request")
    return xr.Dataset({"seconds": (dims, seconds), "qualified": (dims, qualified),
                       **{c: (dims, v) for c, v in counters.items()}},
                      coords={"session": sessions, "prompt": prompts_, "arm": arms, "request": reqs})


def report_markdown(spec: CampaignSpec, records: list[dict], rows: list[dict]) -> str:
    lines = ["# Speculative campaign\n",
             f"k={spec.k}, target ubatch {spec.ubatch}, phase mask {spec.mask}, cap {spec.cap}, backend {spec.backend}, "
             f"draft {spec.draft}, {spec.sessions} sessions x {spec.repeats} requests per block, "
             f"bootstrap {spec.resamples} resamples, seed {spec.seed}, threshold {spec.threshold}\n",
             "## Qualification against R\n", "| arm | prompt | qualified | first diff | median s | accepted/proposals |",
             "|---|---|---|---|---|---|"]
    for a in spec.arms:
        for p in spec.prompts:
            rs = [r for r in records if r["arm"] == a and r["prompt"] == p]
            if not rs:
                continue
            q = all(r["qualified"] for r in rs)
            fd = rs[0]["first_diff"]
            acc = f"{sum(r['accepted'] for r in rs)}/{sum(r['proposals'] for r in rs)}"
            med = float(np.median([r["seconds"] for r in rs]))
            lines.append(f"| {a} | {p} | {'yes' if q else 'NO'} | {'=' if fd is None else fd} | "
                         f"{med:.3f} | {acc} |")
    lines += ["", "## Request-time ratios (qualified arms only)\n",
              "| ratio | estimate | 95% interval | > threshold | note |", "|---|---|---|---|---|"]
    for r in rows:
        if r["qualified"]:
            lines.append(f"| {r['ratio']} | {r['estimate']:.6f} | [{r['lower']:.6f}, {r['upper']:.6f}] | "
                         f"{'yes' if r['above_threshold'] else 'no'} | {r['sessions']} sessions |")
        else:
            lines.append(f"| {r['ratio']} | — | — | — | {r['note']} |")
    return "\n".join(lines) + "\n"


def run_campaign(spec: CampaignSpec, out: Path, progress=None) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    draft = resolve_draft(spec.model, spec.draft) if any(Arm.parse(a).draft for a in spec.arms) else None
    jobs = plan(spec, draft)
    records = qualify_records(run_requests(jobs, progress))
    rows = contrasts(records, spec.ratios, spec.threshold, spec.seed, spec.resamples)
    ds = to_dataset(records)
    with atomic_path(out / "results.nc", umask_mode=True) as tmp:
        ds.to_netcdf(tmp)
    atomic_write_text(out / "records.json", json.dumps(records, indent=1))
    atomic_write_text(out / "contrasts.json", json.dumps(rows, indent=1))
    md = report_markdown(spec, records, rows)
    atomic_write_text(out / "report.md", md)
    return {"records": records, "contrasts": rows, "report": md}


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
        table[int(m)] = {p: all(r["qualified"] for r in rs if r["prompt"] == p) for p in prompts_}
    passing = {m: all(v.values()) for m, v in table.items()}
    _g, minimal = mask_lattice(passing)
    return {"table": table, "passing": passing, "minimal": minimal, "records": records}


def mask_markdown(res: dict, prompts_: list[str]) -> str:
    bits = lambda m: "".join(n if m & b else "-" for n, b in (("TP", 1), ("TC", 2), ("DP", 4), ("DC", 8)))  # noqa
    lines = ["| mask | bits | " + " | ".join(prompts_) + " | all |", "|---|---|" + "---|" * (len(prompts_) + 1)]
    for m, row in sorted(res["table"].items()):
        lines.append(f"| {m} | {bits(m)} | " + " | ".join("Y" if row[p] else "n" for p in prompts_)
                     + f" | {'Y' if res['passing'][m] else 'n'} |")
    lines.append(f"\ninclusion-minimal passing masks: {res['minimal'] or 'none'}\n")
    return "\n".join(lines)
