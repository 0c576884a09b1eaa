"""The reference-preserving speculative path (paper sections 2.2, 3, 4.2, 5, S1).

Arms
  R      reference: target only, physical ubatch 1 everywhere
  M0     target only, batched ubatch U, native multi-query attention (MQ)
  M_x    target only, ubatch U, layout x (SPEC_LAYOUTS but MQ) under the phase mask
  C_x    draft + target, layout x under the phase mask (C0: draft + target, MQ)
Layouts QB and PQ are attention layouts of the patched library (native/patches/0002);
QB+W and PQ+W add row-count-invariant weight products (native/patches/0003): in the phases
the mask selects, every weight product of 1 < n <= max queries rows is computed as n 1-row
products, so the arm needs no row-invariant weight kernels (K-quant models on CPU);
GS serialises target rows: each row is its own decode call, so every physical micrograph
holds one row through the whole model.

Phase mask bits: target prefill 1, target continuation 2, draft prefill 4, draft
continuation 8 (mask 3 = both target phases, the paper's choice).  A scoped guard sets
the layout from the current role and phase before every decode and restores it after.

The transaction: a drafter proposes up to k tokens from the committed history; the
target evaluates the pending token and the proposals in one call of up to k+1 rows (the
target ubatch and the largest query count QB/PQ admit follow k, so one verify is one
micrograph); acceptance by greedy match, correction or bonus; rejected positions are
removed from the target's cache and the drafter's; the pending token is consumed (decoded
into KV) exactly once.

Drafters (:mod:`.drafters`, one grammar): a draft model (`self`, `derive:N`, a GGUF path)
with its own context, or the model-free n-gram drafter `ngram[:NMIN-NMAX][+session]` (prompt
lookup over prompt + output, and with +session over the session's earlier outputs).  k can
adapt within [1, k_max] from the last cycle's acceptance; a gate (calibrated verify costs)
submits a proposal only when its expected gain is positive.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from statelab.analysis.classes import first_difference
from statelab.errors import ConfigError, one_of
from statelab.lab.receiver import Endpoint, check_cap
from statelab.limits import check_threads, check_tokens, int_list
from statelab.runtime import Context, ContextConfig, layouts
from statelab.runtime.layouts import Layout
from statelab.speculative.drafters import (
    Drafter,
    Gate,
    check_gate,
    make_gate,
    ModelDrafter,
    NgramDrafter,
    VerifyCosts,
    check_vocabulary,
    remove_after,
    resolve,
)

# the layouts an arm may name (runtime.layouts.Layout holds their properties)
SPEC_LAYOUTS = tuple(x for x in Layout if x.in_arms)
LAYOUT_NAMES = tuple(x.value for x in SPEC_LAYOUTS)
# R, M0 and C0 run native MQ; M_<layout> (target only) and C_<layout> (draft + target) any other arm layout
ARM_NAMES = ("R", "M0", "C0", *(f"{r}_{x}" for x in LAYOUT_NAMES if x != Layout.MQ for r in "MC"))
TARGET_PREFILL, TARGET_CONT, DRAFT_PREFILL, DRAFT_CONT = 1, 2, 4, 8
PHASE_BITS = {("target", "prefill"): TARGET_PREFILL, ("target", "continuation"): TARGET_CONT,
              ("draft", "prefill"): DRAFT_PREFILL, ("draft", "continuation"): DRAFT_CONT}


def check_mask(mask: int) -> int:
    if not isinstance(mask, (int, np.integer)) or not 0 <= int(mask) <= 15:
        raise ConfigError(f"phase mask must be an integer in 0..15, got {mask!r}")
    return int(mask)


def parse_masks(text: str) -> list[int]:
    """``"0-15"`` (a range) or ``"1,3,7"`` -> the phase masks, each checked."""
    text = str(text)
    if "-" in text:
        try:
            lo, hi = (int(x) for x in text.split("-"))
        except ValueError:
            raise ConfigError(f"--masks must be a range like 0-15 or a comma list, got {text!r}") from None
        masks = list(range(lo, hi + 1))
    else:
        masks = int_list(text, "--masks")
    return [check_mask(m) for m in masks]


def check_layout(name) -> Layout:
    """An arm layout (:data:`SPEC_LAYOUTS`) by name."""
    return Layout.parse(name, SPEC_LAYOUTS)


@dataclass(frozen=True)
class Arm:
    name: str
    layout: Layout
    draft: bool
    reference: bool = False

    @classmethod
    def parse(cls, name: str) -> Arm:
        """An arm by name (:data:`ARM_NAMES`); ConfigError of one line naming them otherwise."""
        if name not in ARM_NAMES:
            raise ConfigError(f"unknown arm {name!r}; use {one_of(ARM_NAMES)}")
        if name == "R":
            return cls("R", Layout.MQ, False, True)
        if name in ("M0", "C0"):
            return cls(name, Layout.MQ, name == "C0")
        return cls(name, check_layout(name[2:]), name[0] == "C")


@dataclass
class Counters:
    proposals: int = 0
    accepted: int = 0
    rollbacks: int = 0
    cycles: int = 0
    target_callers: int = 0
    target_micrographs: int = 0
    draft_callers: int = 0
    layout_not_admitted: int = 0
    verify_calls: int = 0  # continuation calls of the target (cycles; one per token for target-only arms)
    verify_rows: int = 0  # rows submitted by those calls (padding included)
    declined: int = 0  # cycles whose proposal the gate did not submit (expected gain not positive)
    committed: int = 0  # output tokens committed by the continuation (the first comes from the prefill)
    graph_builds: int = 0  # target graphs built / reused by llama.cpp during the continuation
    graph_reuses: int = 0  # (-1 when the layout patch, which counts them, is absent)
    graph_revivals: int = 0  # of those reuses, kept graphs of another shape revived (patch 0008; -1 without)
    # seconds of the continuation (t_cycle) and where they went; the rest is Python around them
    t_cycle: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0  # target decode calls of the verify
    t_sample: float = 0.0  # greedy choices of the verify rows
    t_rollback: float = 0.0  # cache removal (target and drafter) and the drafter's bookkeeping

    def as_dict(self) -> dict:
        return asdict(self)

    def counts(self) -> dict:
        """The counts alone (no times): equal for two arms that took the same steps."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("t_")}


class PhaseGuard:
    """Process-fixed phase mask; sets the context's layout for one decode and restores it."""

    def __init__(self, layout, mask: int = 3):
        self.layout = check_layout(layout)
        self.mask = check_mask(mask)
        self.phase = {"target": "prefill", "draft": "prefill"}

    def new_request(self) -> None:
        self.phase = {"target": "prefill", "draft": "prefill"}

    def active(self, role: str) -> Layout:
        """The layout a decode of `role` in its current phase runs with."""
        return self.layout if self.mask & PHASE_BITS[(role, self.phase[role])] else Layout.MQ

    @contextlib.contextmanager
    def scope(self, ctx, role: str):
        want = self.active(role)
        if want.needs_patch:
            prev = layouts.get_layout(ctx)
            layouts.set_layout(ctx, want)
            try:
                yield want
            finally:
                layouts.set_layout(ctx, prev)
        else:
            yield want


class AdaptiveK:
    """Proposals per cycle: fixed at k, or, with k_max > k, grown by one after a cycle whose
    proposals were all accepted and shrunk to (accepted + 1) after a rejection, within
    [1, k_max]."""

    def __init__(self, k: int, k_max: int | None = None):
        self.k_max = int(k_max or k)
        if not 1 <= k <= self.k_max:
            raise ConfigError(f"need 1 <= k <= k_max, got k={k}, k_max={self.k_max}")
        self.k = int(k)
        self.adaptive = self.k_max > k

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if accepted == proposed:
            if proposed >= self.k:
                self.k = min(self.k_max, self.k + 1)
        else:
            self.k = max(1, min(self.k, accepted + 1))


def _graph_counter(ctx):
    """Start counting the graph builds and reuses of ctx; the returned function reads them."""
    if not layouts.available():
        return lambda: (-1, -1, -1)
    layouts.reset_counters(ctx)

    def read() -> tuple[int, int, int]:
        n = layouts.counters(ctx)
        return n["graph_builds"], n["graph_reuses"], n.get("graph_revivals", -1)
    return read


def verify_plan(gate, key, props: np.ndarray, hist: np.ndarray, L: int, prev_rows: int,
                rows_fixed: int | None) -> tuple[int, int]:
    """(proposals submitted, rows of the verify call) of one cycle: the gate's choice (all of
    ``props`` without a gate), then with a fixed verify shape ``rows_fixed`` rows unless the
    gate's cycle without proposals is a one-row decode.  ``hist[:L]``: the committed history."""
    p = len(props) if gate is None else gate.choose(key, props, hist, L, prev_rows, rows_fixed)
    if rows_fixed and (gate is None or p or gate.plain(prev_rows, rows_fixed)[0] > 1):
        return p, rows_fixed
    return p, p + 1


def cycle_proposal(drafter: Drafter, gate, hist: np.ndarray, L: int, k: int) -> tuple[np.ndarray, object]:
    """(proposal, its key) of one cycle for ``hist[:L]``: the drafter's ``k`` tokens, or none
    where the gate needs none this cycle (:meth:`ShadowGate.wants_proposal`: plain, its shadow
    proposal still open).  A drafter with its own context always proposes: proposing is
    how it consumes the pending token."""
    if gate is not None and not drafter.needs_model and not gate.wants_proposal(hist, L):
        return hist[:0], None
    return drafter.propose(hist[:L], k), drafter.key


def proposal_length(kp: AdaptiveK, fixed_rows: bool, left: int) -> int:
    """How many tokens to ask the drafter for: k, or k_max with a fixed verify shape (the call
    has k_max + 1 rows whatever is proposed, so a shorter proposal saves nothing), at most
    ``left`` (what the cap leaves)."""
    return min(kp.k_max if fixed_rows else kp.k, left)


def _micrographs(rows: int, ubatch: int) -> int:
    return -(-rows // ubatch)


class Transaction:
    """One request through an arm: prefill, then continuation (speculative or not).

    A speculative cycle: the drafter proposes up to k tokens from the committed history; the
    target verifies pending + proposals in one call (GS: one call per row) with logits for
    every row; the greedy choices of the rows are one vectorised argmax; the longest agreeing
    prefix is accepted plus the target's own next token (correction or bonus); rejected
    positions are removed from the target's cache (and the drafter's).  With fixed_rows the
    verify always submits k_max + 1 rows (the unused ones repeat the last token and are
    removed afterwards): under QB every row is computed independently of the others, so the
    padding changes no committed logit while the graph keeps one shape and is reused."""

    plain_runs = True  # a gate's plain regime as one loop of R's step (False, per instance: the general cycle each)

    def __init__(self, arm: Arm, target_ctx, draft_ctx=None, k: int = 3, mask: int = 3, drafter: Drafter | None = None,
                 k_max: int | None = None, fixed_rows: bool = False, gate: Gate | None = None):
        self.arm, self.t = arm, target_ctx
        self.kpolicy = AdaptiveK(k, k_max)
        self.k = self.kpolicy.k
        self.guard = PhaseGuard(arm.layout, mask)
        self.c = Counters()
        if arm.draft and drafter is None:
            if draft_ctx is None:
                raise ConfigError(f"arm {arm.name} needs a draft model or a model-free drafter")
            drafter = ModelDrafter()
        self.drafter = drafter.bind(draft_ctx, self) if drafter is not None else None
        self.fixed_rows = bool(fixed_rows) and not arm.layout.serialised
        self.gate = gate

    # -- decode helpers --------------------------------------------------
    def _step(self, tok: int, pos: int) -> int:
        """Target-only continuation: one row, the native greedy sampler in place."""
        with self.guard.scope(self.t, "target"):
            return self._held_step(tok, pos)

    def _held_step(self, tok: int, pos: int) -> int:
        """:meth:`_step` inside a guard scope the caller holds (the target's layout already set)."""
        self.t.decode([tok], pos)
        self.c.target_callers += 1
        self.c.target_micrographs += 1
        return self.t.greedy_row(-1)

    def _verify(self, tokens: np.ndarray, pos0: int, need: int) -> np.ndarray:
        """Decode the verify rows under the guard; the greedy choices of the first `need` rows."""
        rows = len(tokens)
        self.c.verify_rows += rows
        with self.guard.scope(self.t, "target") as layout:
            if layout.serialised:  # global serialisation: one row per decode call
                choices = np.empty(rows, dtype=np.int64)
                for i in range(rows):
                    t0 = time.perf_counter()
                    self.t.decode(tokens[i:i + 1], pos0 + i, logits="all")
                    self.t.synchronize()
                    t1 = time.perf_counter()
                    choices[i] = self.t.argmax_rows(1)[0]
                    self.c.t_verify += t1 - t0
                    self.c.t_sample += time.perf_counter() - t1
                self.c.target_callers += rows
                self.c.target_micrographs += rows
                return choices[:need]
            t0 = time.perf_counter()
            if rows == 1:  # a cycle without proposals: the one-token step of R (no numpy batch, one logits row)
                self.t.decode([int(tokens[0])], pos0)
            else:
                self.t.decode(tokens, pos0, logits="all")
            self.t.synchronize()  # the device's work counts as verify decode, not as sampling
            t_dec = time.perf_counter()  # admission check and layout restore below are bookkeeping (python)
            self.c.target_callers += 1
            self.c.target_micrographs += _micrographs(rows, self.t.config.n_ubatch)
            if layout.needs_patch and rows > 1:
                if not layouts.last_admission(self.t).admitted:
                    self.c.layout_not_admitted += 1
        t1 = time.perf_counter()
        choices = self.t.argmax_rows(need)
        self.c.t_verify += t_dec - t0
        self.c.t_sample += time.perf_counter() - t1
        return choices

    def _target_prefill(self, tokens) -> np.ndarray:
        with self.guard.scope(self.t, "target") as layout:
            if layout.serialised:
                last = len(tokens) - 1
                for i, tok in enumerate(tokens):  # logits of the last row only, as in the batched path
                    self.t.decode([tok], i, logits=None if i == last else "none")
                    self.c.target_callers += 1
                    self.c.target_micrographs += 1
            else:
                n_batch = self.t.config.n_batch
                for s in range(0, len(tokens), n_batch):
                    chunk = tokens[s:s + n_batch]
                    last = s + len(chunk) == len(tokens)
                    self.t.decode(chunk, s, logits=None if last else "none")
                    self.c.target_callers += 1
                    self.c.target_micrographs += _micrographs(len(chunk), self.t.config.n_ubatch)
        self.guard.phase["target"] = "continuation"
        return self.t.logits(-1)

    def _plain_run(self, hist: np.ndarray, L: int, n_max: int, prev_rows: int) -> int:
        """The gate's plain regime as one loop: R's one-token step per cycle (decode and the
        greedy choice in place), committed into ``hist`` from ``L`` on.  Under an open shadow
        proposal that agrees so far a cycle asks nothing; where it has ended, the cycle settles
        it and, still plain, asks the drafter for the next one, as the general cycle would.  The
        loop ends where the gate turns to drafting, at an end-of-generation token or after
        ``n_max`` tokens; a cycle whose plan is not one row (the gate turned while choosing) is
        left to the general cycle, which asks the drafter again (a model-free drafter's
        proposal depends on the history alone; both lookups count in ``t_draft``, as both ran).
        The tokens, calls, rows and counters are those of the general cycle with no proposal;
        its per-cycle host work (verify plan, numpy bookkeeping, rollback check) is what this
        saves.  Returns the tokens committed."""
        model, c, gate, kp = self.t.model, self.c, self.gate, self.kpolicy
        rows_fixed = kp.k_max + 1 if self.fixed_rows else None
        tok, pos = int(hist[L - 1]), L - 1
        n = 0
        # the target's layout is set once for the run, not around every call (on the H100 the set
        # and restore cost 0.05 ms of a 1.5 ms one-token call: `benchmarks/plain_cycle.py`, "ctx,
        # step" against "ctx, no guard"); nothing else decodes on the target inside the run
        with self.guard.scope(self.t, "target"):
            while n < n_max and gate.is_plain():
                Lc = L + n
                t0 = time.perf_counter()
                if gate.wants_proposal(hist, Lc):  # settles a shadow proposal that has ended
                    props, key = cycle_proposal(self.drafter, gate, hist, Lc, proposal_length(kp, self.fixed_rows, n_max - n))
                    c.t_draft += time.perf_counter() - t0
                    if not gate.is_plain() or verify_plan(gate, key, props, hist, Lc, prev_rows, rows_fixed) != (0, 1):
                        break
                t1 = time.perf_counter()
                tok = self._held_step(tok, pos)
                t2 = time.perf_counter()
                hist[Lc] = tok
                n += 1
                pos += 1
                c.t_verify += t2 - t1
                # the gate prices the whole cycle, its shadow proposal's lookup included, as it does
                # a drafting cycle (from before its proposal to after its rollback)
                gate.update(None, 0, 0, 1, prev_rows, t2 - t0)
                prev_rows = 1
                if model.is_eog(tok):
                    break
        c.cycles += n
        c.verify_calls += n
        c.verify_rows += n
        c.committed += n
        c.declined = gate.declined
        return n

    # -- the request --------------------------------------------------------
    def run(self, prompt_tokens: np.ndarray, cap: int) -> Endpoint:
        cap = check_cap(cap)
        model = self.t.model
        self.guard.new_request()
        self.t.clear()
        toks = np.asarray(prompt_tokens, dtype=np.int32)
        n_past = len(toks)
        margin = self.kpolicy.k_max + 1 if self.arm.draft else 0
        if n_past + cap + margin > self.t.n_ctx:
            raise ConfigError(f"prompt ({n_past}) + cap ({cap}) + verify rows ({margin}) exceed n_ctx={self.t.n_ctx}")
        pending = self.t.greedy(self._target_prefill(toks))
        if not self.arm.draft:
            out = [pending]
            t0 = time.perf_counter()
            while not (model.is_eog(out[-1]) or len(out) >= cap):
                pending = self._step(pending, n_past)
                n_past += 1
                out.append(pending)
            self.c.t_cycle += time.perf_counter() - t0
            self.c.committed += len(out) - 1
            self.c.verify_calls += len(out) - 1
            eog = model.is_eog(out[-1])
            return Endpoint(np.asarray(out, dtype=np.int32), eog, "eog" if eog else "cap")
        return self._speculate(toks, pending, cap)

    def _speculate(self, toks: np.ndarray, pending: int, cap: int) -> Endpoint:
        model, c, kp = self.t.model, self.c, self.kpolicy
        kp.k = self.k  # a new request starts from the initial k
        self.drafter.start(toks)
        n0 = len(toks)
        hist = np.empty(n0 + cap + kp.k_max + 1, dtype=np.int32)  # prompt + committed output
        hist[:n0] = toks
        hist[n0] = pending
        L = n0 + 1  # the history's length; its last token is pending (not in the target's KV)
        rows_fixed = kp.k_max + 1
        verify = np.empty(rows_fixed, dtype=np.int32)
        graphs = _graph_counter(self.t)
        gate, prev_rows = self.gate, 0
        # a model drafter proposes every cycle (proposing consumes the pending token in its context)
        plain_runs = self.plain_runs and gate is not None and not self.drafter.needs_model
        if gate is not None:
            gate.start()
            gate.declined = 0
        t_start = time.perf_counter()
        while True:
            n_out = L - n0
            if model.is_eog(int(hist[L - 1])) or n_out >= cap:
                break
            n_past = L - 1
            if plain_runs and gate.is_plain():
                n = self._plain_run(hist, L, cap - n_out, prev_rows)
                if n:
                    L += n
                    prev_rows = 1
                    continue
            t0 = time.perf_counter()
            full, key = cycle_proposal(self.drafter, gate, hist, L, proposal_length(kp, self.fixed_rows, cap - n_out))
            p, rows = verify_plan(gate, key, full, hist, L, prev_rows, rows_fixed if self.fixed_rows else None)
            props = full[:p]
            t1 = time.perf_counter()
            c.t_draft += t1 - t0
            verify[0] = hist[L - 1]
            verify[1:p + 1] = props
            verify[p + 1:rows] = verify[p]  # padding rows repeat the last token
            before, prev_rows = prev_rows, rows
            choices = self._verify(verify[:rows], n_past, p + 1)
            t2 = time.perf_counter()
            agree = props == choices[:p]
            m = p if agree.all() else int(np.argmin(agree))
            c.proposals += p
            c.accepted += m
            c.cycles += 1
            c.verify_calls += 1
            kp.update(p, m)
            # the target's KV holds pending + props[:m] (+ rejected and padding rows): drop the rest
            if rows > m + 1:
                remove_after(self.t, n_past + m + 1)
            if m < p:
                c.rollbacks += 1
            self.drafter.settle(n_past, full, m)  # all it proposed: a model drafter decoded them
            t3 = time.perf_counter()
            c.t_rollback += t3 - t2
            if gate is not None:
                gate.update(key, p, m, rows, before, t3 - t0)
                c.declined = gate.declined
            new = np.append(props[:m], choices[m]).astype(np.int32)
            eog = np.flatnonzero([model.is_eog(int(t)) for t in new]) if len(new) > 1 else ()
            keep = min(len(new), cap - n_out, int(eog[0]) + 1 if len(eog) else len(new))
            hist[L:L + keep] = new[:keep]
            L += keep
            c.committed += keep
        c.t_cycle += time.perf_counter() - t_start
        c.graph_builds, c.graph_reuses, c.graph_revivals = graphs()
        out = hist[n0:L].copy()
        eog = model.is_eog(int(out[-1]))
        return Endpoint(out, eog, "eog" if eog else "cap")


@dataclass
class ArmResult:
    arm: str
    prompt_id: str
    endpoint: Endpoint
    seconds: float
    counters: Counters
    qualified: bool | None = None
    first_diff: int | None = None
    extra: dict = field(default_factory=dict)
    prompt_sha256: str = ""

    @property
    def prompt_key(self) -> tuple[str, str]:
        """A prompt is its id and the sha256 of its text (two files of one base name differ)."""
        return self.prompt_id, self.prompt_sha256

    def record(self) -> dict:
        return {"arm": self.arm, "prompt": self.prompt_id, "prompt_sha256": self.prompt_sha256,
                "seconds": self.seconds, "qualified": self.qualified,
                "first_diff": self.first_diff, "length": self.endpoint.length, "eog": self.endpoint.eog,
                "tokens": [int(t) for t in self.endpoint.tokens], **self.counters.as_dict(), **self.extra}


@dataclass
class SpecConfig:
    k: int = 3  # proposals per cycle (the initial k when k_max > k)
    ubatch: int = 0  # target ubatch; 0: follows k (k_max + 1, so one verify is one micrograph)
    mask: int = 3
    cap: int = 128
    n_ctx: int = 1024
    threads: int = 0
    backend: str = "cpu"
    max_queries: int = 0  # largest query count QB/PQ admit; 0: the target ubatch
    k_max: int | None = None  # adaptive k within [1, k_max] (None: k fixed)
    fixed_rows: bool = False  # verify always submits k_max + 1 rows (one graph shape, reused)
    graph_keep: int = 4  # graphs of earlier shapes each target context keeps (patch 0008; 0: rebuild on a change)

    def __post_init__(self):
        layouts.check_graph_keep(self.graph_keep)
        check_tokens("k", self.k)
        if self.k_max is not None:
            check_tokens("k_max", self.k_max)
            if self.k_max < self.k:
                raise ConfigError(f"k_max ({self.k_max}) must be >= k ({self.k})")
        if self.ubatch:  # 0: follows k
            check_tokens("the target ubatch", self.ubatch)
        if self.max_queries:  # 0: the target ubatch
            check_tokens("max queries", self.max_queries)
        check_tokens("n_ctx", self.n_ctx)
        check_threads("the thread count", self.threads)
        check_mask(self.mask)
        check_cap(self.cap)

    @property
    def rows(self) -> int:
        """The most rows one verify submits."""
        return (self.k_max or self.k) + 1

    @property
    def target_ubatch(self) -> int:
        return self.ubatch or self.rows

    @property
    def queries(self) -> int:
        return self.max_queries or self.target_ubatch


check_draft_paths = check_vocabulary


def check_draft(target_model, draft_model) -> None:
    check_vocabulary(target_model.path, draft_model.path)


class Runner:
    """Owns target and draft models and builds per-arm contexts.

    draft: a model-free drafter (its text, e.g. ``ngram:1-8+session``, or a :class:`Drafter`)
    or None; a draft model is given as draft_model instead.  costs: arm -> the verify costs
    (:class:`VerifyCosts`) its gate (of kind ``gate``: :data:`~statelab.speculative.drafters.GATES`)
    uses; an arm without costs submits every proposal.  The
    drafter is one object for every request of this runner: a session drafter keeps the
    outputs it is told to remember (``run(..., learn=True)``)."""

    def __init__(self, target_model, draft_model=None, cfg: SpecConfig | None = None, vocab_checked: bool = False,
                 draft: str | Drafter | None = None, costs: dict[str, VerifyCosts] | None = None,
                 gate: str | bool = "gain"):
        """vocab_checked: the caller already ran check_draft_paths on these files (before loading)."""
        self.tm, self.dm, self.cfg = target_model, draft_model, cfg or SpecConfig()
        self.drafter = resolve(draft, target_model) if isinstance(draft, str) else draft
        if self.drafter is not None and self.drafter.needs_model and draft_model is None:
            raise ConfigError(f"drafter {self.drafter.text!r} needs its draft model loaded (draft_model)")
        if self.drafter is None and draft_model is not None:
            self.drafter = ModelDrafter(getattr(draft_model, "path", None))
        self.costs = dict(costs or {})
        self.gate = gate
        check_gate(gate)  # an unknown kind is refused before any request
        if draft_model is not None and draft_model is not target_model and not vocab_checked:
            check_draft(target_model, draft_model)

    @property
    def ngram(self) -> tuple[int, int] | None:
        d = self.drafter
        return (d.nmin, d.nmax) if isinstance(d, NgramDrafter) else None

    def contexts(self, arm: Arm):
        c = self.cfg
        if arm.layout.needs_patch:
            if not layouts.available():
                raise ConfigError(f"arm {arm.name} needs the attention-layout patch (native/patches/0002)")
            if not 1 <= c.queries <= layouts.MAX_QUERIES_LIMIT:
                raise ConfigError(f"arm {arm.name}: {c.queries} queries per micrograph exceed the layout limit "
                                  f"{layouts.MAX_QUERIES_LIMIT} (lower k_max or ubatch)")
            if arm.layout.repair and not layouts.weight_repair_available():
                raise ConfigError(f"arm {arm.name} needs the weight-product patch "
                                  "(native/patches/0003-row-invariant-weight-products.patch)")
            why = layouts.patch_refusal(arm.layout, c.backend)
            if why:
                raise ConfigError(f"arm {arm.name}: {why}")
        ub = 1 if arm.reference else c.target_ubatch
        tcfg = ContextConfig(backend=c.backend, n_ctx=c.n_ctx, n_batch=max(512, c.rows), n_ubatch=ub,
                             n_threads=c.threads)
        t = Context(self.tm, tcfg)
        if arm.layout.needs_patch:
            layouts.set_max_queries(t, c.queries)
        if c.graph_keep and layouts.available():
            layouts.set_graph_keep(t, c.graph_keep)
        d = None
        if arm.draft and (self.drafter is None or self.drafter.needs_model):
            if self.dm is None:
                raise ConfigError(f"arm {arm.name} needs a drafter (--draft)")
            dcfg = ContextConfig(backend=c.backend, n_ctx=c.n_ctx, n_batch=512, n_ubatch=1, n_threads=c.threads)
            d = Context(self.dm, dcfg)
        return t, d

    def transaction(self, arm: Arm, t, d) -> Transaction:
        c = self.cfg
        gate = make_gate(self.gate, self.costs[arm.name]) if arm.draft and arm.name in self.costs else None
        return Transaction(arm, t, d, c.k, c.mask, drafter=self.drafter if arm.draft else None, k_max=c.k_max,
                           fixed_rows=c.fixed_rows, gate=gate)

    def run(self, arm_name: str, prompt, warmup: bool = False, learn: bool = False) -> ArmResult:
        """One request (after a short warm-up request when asked); with ``learn`` a session
        drafter remembers its output for the next requests."""
        arm = Arm.parse(arm_name)
        t, d = self.contexts(arm)
        try:
            tx = self.transaction(arm, t, d)
            toks = self.tm.tokenize(prompt.text)
            if warmup:
                tx.run(toks, min(8, self.cfg.cap))
                tx.c = Counters()
            t0 = time.perf_counter()
            ep = tx.run(toks, self.cfg.cap)
            dt = time.perf_counter() - t0
        finally:
            t.close()
            if d is not None:
                d.close()
        if learn and arm.draft and self.drafter is not None:
            self.drafter.remember(ep.tokens)
        return ArmResult(arm.name, prompt.id, ep, dt, tx.c, prompt_sha256=prompt.sha256)

    def measure_verify_costs(self, arm_name: str, prompt, calls: int = 5) -> VerifyCosts:
        """Calibration of the gate on this device: after prefilling ``prompt``, the median time
        of a verify call (decode + greedy choices, the transaction's own path) of r = 1 .. k_max+1
        rows, each shape ``calls`` times after two warm-up calls (same shape: the graph reused),
        then each shape ``calls`` times right after a call of another shape (rebuilt)."""
        arm = Arm.parse(arm_name)
        t, d = self.contexts(arm)
        try:
            tx = Transaction(arm, t, d, self.cfg.k, self.cfg.mask, drafter=None if d is not None else NgramDrafter(),
                             k_max=self.cfg.k_max)
            toks = np.asarray(self.tm.tokenize(prompt.text), dtype=np.int32)
            n0 = len(toks)
            tx._target_prefill(toks)
            R = self.cfg.rows
            pad = np.resize(toks, R).astype(np.int32)

            def call(r: int) -> float:
                t0 = time.perf_counter()
                tx._verify(pad[:r], n0, r)
                dt = time.perf_counter() - t0
                remove_after(t, n0)
                return dt

            same = []
            for r in range(1, R + 1):
                call(r)
                call(r)
                same.append(float(np.median([call(r) for _ in range(calls)])))
            change = []
            for r in range(1, R + 1):
                other = r % R + 1 if R > 1 else r
                ts = []
                for _ in range(calls):
                    call(other)
                    ts.append(call(r))
                change.append(float(np.median(ts)))
        finally:
            t.close()
            if d is not None:
                d.close()
        return VerifyCosts(tuple(same), tuple(change))


def qualify(results: list[ArmResult]) -> list[ArmResult]:
    """Mark each arm qualified when its complete endpoint equals R's on the same prompt."""
    refs = {r.prompt_key: r for r in results if r.arm == "R"}
    for r in results:
        ref = refs.get(r.prompt_key)
        if ref is None:
            r.qualified = None
            continue
        r.first_diff = first_difference(ref.endpoint.tokens, r.endpoint.tokens)
        r.qualified = r.endpoint.same(ref.endpoint)
    return results
