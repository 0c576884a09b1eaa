"""Speculative campaigns: qualification against R, complete request times in fresh worker
processes, counterbalanced blocks, session-level log contrasts with a percentile bootstrap
(paper 4.2, S3.1).  The requests themselves: :mod:`.spec_run`; the phase-mask
experiment: :mod:`.masks`."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from statelab import prompts
from statelab.analysis.classes import bootstrap_ratio_interval
from statelab.resources import spec_file
from statelab.runtime.admission import device_refusal
from statelab.errors import ConfigError
from statelab.experiments import engine
from statelab.experiments.engine import Kind, Summary
from statelab.experiments.folder import RunFolder, normalized_hash
from statelab.experiments.log import CellLog, first_ok
from statelab.experiments.records import CAMPAIGN_BLOCK
from statelab.experiments.spec_run import BLOCK, prompt_key, qualify_records, resolve_draft
from statelab.experiments.specfile import check_keys, read_toml
from statelab.models import model_sha256, resolve_model
from statelab.paths import atomic_write_netcdf, atomic_write_text
from statelab.runtime import Model, prepare_backend
from statelab.runtime.layouts import Layout
from statelab.speculative import drafters
from statelab.speculative.transaction import Arm, SpecConfig

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
    graph_keep: int = 4  # graphs of earlier shapes a target context keeps (patch 0008; 0: rebuild on a change)
    gate: bool | str = False  # a proposal gate over verify costs calibrated per session: "gain" (true) or "shadow"
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
        p = spec_file(path)
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
                 "draft": (str, type(None)), "k_max": (int, type(None)), "fixed_rows": bool, "graph_keep": int, "gate": (bool, str),
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
        drafters.check_gate(self.gate)

    def spec_config(self) -> SpecConfig:
        return SpecConfig(k=self.k, ubatch=self.ubatch, mask=self.mask, cap=self.cap, n_ctx=self.n_ctx,
                          backend=self.backend,
                          threads=self.threads, k_max=self.k_max, fixed_rows=self.fixed_rows,
                          graph_keep=self.graph_keep)

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
                extra = {"gate": spec.gate} if spec.gate and Arm.parse(arm).draft else {}
                add(session=s, prompt=p, arm=arm, draft=draft if Arm.parse(arm).draft else None, prompt_index=pi,
                    **extra)
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


def gate_words(gate) -> str:
    """The report header's words for a spec's gate."""
    if not gate:
        return ""
    return f", gated by calibrated verify costs ({'gain' if gate is True else gate})"


def report_markdown(spec: CampaignSpec, records: list[dict], rows: list[dict], parts: list[dict] | None = None,
                    costs: dict | None = None) -> str:
    lines = ["# Speculative campaign\n",
             f"k={spec.k}{f' (adaptive, k_max {spec.k_max})' if spec.k_max else ''}, "
             f"target ubatch {spec.spec_config().target_ubatch}, "
             f"{'fixed-shape verify, ' if spec.fixed_rows else ''}phase mask {spec.mask}, cap {spec.cap}, "
             f"backend {spec.backend}, draft {spec.draft}{gate_words(spec.gate)}, "
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
LATER_FIELDS = {"gate": False, "n_ctx": 1024, "graph_keep": 0}  # fields added later: at their default they leave older campaigns' hashes as they were


SPEC_FORMAT = "statelab.campaign-spec/1"  # OUT/spec.json of a campaign folder


def campaign_identity(spec: CampaignSpec, draft: str | None) -> list:
    """What a campaign's blocks measured: the spec's block fields, every prompt's id and text
    hash, the target model's sha256 and the resolved drafter (analysis-only fields may change
    between runs of one folder).  OUT/spec.json holds it as its normal form."""
    fields = {k: v for k, v in asdict(spec).items()
              if k not in ANALYSIS_FIELDS and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
    fields["prompts"] = [key for _, key in spec.prompt_table()]
    fields["model"] = model_sha256(resolve_model(spec.model))
    return [fields, draft]


def campaign_hash(spec: CampaignSpec, draft: str | None) -> str:
    """The campaign's spec hash: :func:`campaign_identity` hashed as every kind's normal form."""
    return normalized_hash(campaign_identity(spec, draft))


def refused_arms(spec: CampaignSpec) -> dict[str, str]:
    """Arms whose layout the target device would not run (its supports_op rejects the attention
    products, which the scheduler would then run on the CPU): arm -> reason. Empty on the CPU."""
    if not any(Layout(Arm.parse(a).layout).device_must_admit(spec.backend) for a in spec.arms):
        return {}
    with Model(spec.model, backend=spec.backend) as m:
        q = spec.spec_config().queries
        why = {a: device_refusal(m, Arm.parse(a).layout, q) for a in spec.arms}
    return {a: w for a, w in why.items() if w}


# -- the campaign as a kind of the engine -------------------------------------------


def _identity(run) -> tuple[str, dict]:
    """Refused arms, the resolved drafter and the blocks; a folder whose blocks are another
    campaign's is refused in the campaign's own words, and one that holds this campaign's
    blocks from before campaign folders had a spec.json gets it now."""
    spec, out = run.spec, run.out
    refused = refused_arms(spec)
    if refused:
        raise ConfigError("; ".join(f"{a}: {w}" for a, w in refused.items()) + ": drop these arms from the campaign")
    draft = resolve_draft(spec.model, spec.draft) if any(Arm.parse(a).draft for a in spec.arms) else None
    ident = campaign_identity(spec, draft)
    h = normalized_hash(ident)
    log = CellLog(out / "blocks.jsonl", CAMPAIGN_BLOCK, error=ConfigError)
    old = log.records()
    if any(r.get("spec_hash") != h for r in old):
        raise ConfigError(f"{out} holds blocks of another campaign (spec or drafter changed); name a new --out")
    record = {"format": SPEC_FORMAT, "spec_hash": h, "normalized": ident}
    if old and not run.folder.spec_path.is_file():
        atomic_write_text(run.folder.spec_path, json.dumps(record, indent=2, sort_keys=True))
    jobs = plan(spec, draft)
    for j in jobs:
        j["key"] = f"block-{j['block']}"
    run.state.update(log=log, jobs=jobs, session=draft is not None and draft.endswith("+session"),
                     done=first_ok(old, h))
    return h, record


def _plan(run) -> tuple[list[dict], list]:
    feed(run.state["jobs"], run.state["done"], run.state["session"])
    return run.state["jobs"], []


def _accept(run, res: dict) -> dict:
    jobs, done = run.state["jobs"], run.state["done"]
    job = jobs[res["block"]]
    if "error" in res:
        raise ConfigError(f"block {job['block']} ({job['arm']} on {job['prompt']}): {res['error']}")
    entry = {"key": job["key"], "status": "ok", "spec_hash": run.spec_hash, "records": res["records"],
             **({"costs": res["costs"]} if "costs" in res else {})}
    run.state["log"].append(entry)
    done[entry["key"]] = entry
    feed(jobs, done, run.state["session"])  # the next blocks of the session hear this one (serial: before they start)
    return entry


def _stop(run):
    budget_s = run.options.get("budget_s")
    if budget_s is None:
        return None
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0 > budget_s


def _compile(run) -> dict | None:
    jobs = run.state["jobs"]
    done = first_ok(run.state["log"].records(), run.spec_hash)
    if len(done) < len(jobs):
        return None
    res = compile_campaign(run.spec, run.out, jobs, done)
    return {**res, "report_path": run.out / "report.md", "results_path": run.out / "results.nc"}


CAMPAIGN = Kind(
    "campaign", "statelab.experiments.spec_run", ConfigError, CampaignSpec.load,
    folder=lambda spec, out: RunFolder(Path(out), SPEC_FORMAT, ConfigError, "campaign"),
    identity=_identity, plan=_plan, done=lambda run: run.state["done"], unit=lambda run: BLOCK,
    accept=_accept, stop=_stop, compile=_compile)


def run_campaign(spec: CampaignSpec, out: Path, progress=None, budget_s: float | None = None) -> Summary:
    """Run (or resume) a campaign in ``out`` through the engine, one block at a time: every
    finished block is appended to out/blocks.jsonl (flushed, fsynced) and skipped when the same
    campaign is run again in the same folder; with ``budget_s``, no new block starts after that
    many seconds and the summary says ``complete`` False (run again to continue).  Reports are
    written once every block has run (``outputs``: records, contrasts, breakdown, costs, report)."""
    return engine.run(CAMPAIGN, spec, out, "local", 1, progress=progress, budget_s=budget_s)


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
