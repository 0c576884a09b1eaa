"""Partition studies: natural endpoints of several schedules, shams, whole-KV crosses,
and partition sweeps with equivalence classes (paper 6.1, S4)."""
from __future__ import annotations

from dataclasses import dataclass, field

from statelab.analysis.classes import endpoint_class, first_difference, kv_profile_dataset, trajectory_classes
from statelab.analysis.frontier import _top_two
from statelab.errors import ConfigError
from statelab.kvstate import compare
from statelab.lab.formation import PRESETS, Schedule, paper_sweep, parse_schedule, partition_sweep, prefill
from statelab.lab.intervene import config_of, cross, natural, sham
from statelab.lab.receiver import DEFAULT_CAP, continue_greedy
from statelab.runtime import Context


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


def partition_dataset(results: list[PromptResult], backend: str, cap: int):
    """The natural arms of a partition study as an xarray Dataset: ``margin`` and ``token``
    (task, arm, output; NaN / -1 past an endpoint), ``first_diff`` of the first two arms
    (task; -1 equal), and the per-layer K/V differences of their states (task, layer,
    component): ``changed_bytes``, ``max_abs``, ``l2``, ``l2_rel``.  Needs ``trace=True``."""
    import numpy as np
    import xarray as xr


    arms = list(results[0].natural)
    n_out = max(len(ep.tokens) for r in results for ep in r.natural.values())
    margin = np.full((len(results), len(arms), n_out), np.nan)
    token = np.full((len(results), len(arms), n_out), -1, np.int32)
    first = np.full(len(results), -1, np.int64)
    profiles = []
    for i, r in enumerate(results):
        if set(r.margins) != set(arms):
            raise ValueError("partition_dataset needs study_prompt(..., trace=True) results")
        for j, a in enumerate(arms):
            margin[i, j, :len(r.margins[a])] = r.margins[a]
            token[i, j, :len(r.natural[a].tokens)] = r.natural[a].tokens
        fd = first_difference(r.natural[arms[0]].tokens, r.natural[arms[1]].tokens) if len(arms) > 1 else None
        first[i] = -1 if fd is None else fd
        other = arms[1] if len(arms) > 1 else arms[0]
        profiles.append(kv_profile_dataset(compare(r.captures[arms[0]].state, r.captures[other].state).records()))
    tasks = [r.prompt_id for r in results]
    ds = xr.Dataset({"margin": (("task", "arm", "output"), margin, {"description": "top-1 minus top-2 logit"}),
                     "token": (("task", "arm", "output"), token),
                     "first_diff": (("task",), first, {"description": "first differing output of the first two "
                                                       "arms' natural endpoints (-1 equal)"})},
                    coords={"task": tasks, "arm": arms, "output": np.arange(n_out)})
    ds = ds.merge(xr.concat(profiles, dim="task").assign_coords(task=tasks))
    ds.attrs.update(backend=backend, cap=int(cap), pair=f"{arms[0]}/{arms[1] if len(arms) > 1 else arms[0]}")
    return ds
