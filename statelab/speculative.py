"""The reference-preserving speculative path (paper sections 2.2, 3, 4.2, 5, S1).

Arms
  R      reference: target only, physical ubatch 1 everywhere
  M0     target only, batched ubatch U, native multi-query attention (MQ)
  M_x    target only, ubatch U, layout x in {QB, PQ, GS} under the phase mask
  C_x    draft + target, layout x under the phase mask (C0: draft + target, MQ)
Layouts QB and PQ are attention layouts of the patched library (native/patches/0002);
GS serialises target rows: each row is its own decode call, so every physical micrograph
holds one row through the whole model.

Phase mask bits: target prefill 1, target continuation 2, draft prefill 4, draft
continuation 8 (mask 3 = both target phases, the paper's choice).  A scoped guard sets
the layout from the current role and phase before every decode and restores it after.

The transaction: the draft proposes up to k greedy tokens; the target evaluates the
pending token and the proposals in one call of k+1 rows; acceptance by greedy match,
correction or bonus; rejected positions are removed from both caches; the pending
token is consumed (decoded into KV) exactly once.
"""
from __future__ import annotations

import contextlib
import re
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import ConfigError, IdentityError
from .limits import check_threads, check_tokens
from .receiver import Endpoint, check_cap

LAYOUT_NAMES = ("MQ", "PQ", "QB", "GS")
TARGET_PREFILL, TARGET_CONT, DRAFT_PREFILL, DRAFT_CONT = 1, 2, 4, 8
PHASE_BITS = {("target", "prefill"): TARGET_PREFILL, ("target", "continuation"): TARGET_CONT,
              ("draft", "prefill"): DRAFT_PREFILL, ("draft", "continuation"): DRAFT_CONT}
ARM_RE = re.compile(r"^(R|M0|C0|[MC]_(QB|PQ|GS))$")


def check_mask(mask: int) -> int:
    if not isinstance(mask, (int, np.integer)) or not 0 <= int(mask) <= 15:
        raise ConfigError(f"phase mask must be an integer in 0..15, got {mask!r}")
    return int(mask)


def check_layout(name: str) -> str:
    if name not in LAYOUT_NAMES:
        raise ConfigError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUT_NAMES)}")
    return name


@dataclass(frozen=True)
class Arm:
    name: str
    layout: str  # MQ, PQ, QB, GS
    draft: bool
    reference: bool = False

    @classmethod
    def parse(cls, name: str) -> "Arm":
        if not ARM_RE.match(name):
            raise ConfigError(f"unknown arm {name!r}; use R, M0, C0, M_QB, M_PQ, M_GS, C_QB, C_PQ, C_GS")
        if name == "R":
            return cls("R", "MQ", False, True)
        if name in ("M0", "C0"):
            return cls(name, "MQ", name == "C0")
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

    def as_dict(self) -> dict:
        return asdict(self)


class PhaseGuard:
    """Process-fixed phase mask; sets the context's layout for one decode and restores it."""

    def __init__(self, layout: str, mask: int = 3):
        self.layout = check_layout(layout)
        self.mask = check_mask(mask)
        self.phase = {"target": "prefill", "draft": "prefill"}

    def new_request(self) -> None:
        self.phase = {"target": "prefill", "draft": "prefill"}

    def active(self, role: str) -> str:
        """The layout a decode of `role` in its current phase runs with."""
        return self.layout if self.mask & PHASE_BITS[(role, self.phase[role])] else "MQ"

    @contextlib.contextmanager
    def scope(self, ctx, role: str):
        want = self.active(role)
        if want in ("PQ", "QB"):
            from .runtime import layouts

            prev = layouts.get_layout(ctx)
            layouts.set_layout(ctx, want)
            try:
                yield want
            finally:
                layouts.set_layout(ctx, prev)
        else:
            yield want


def _micrographs(rows: int, ubatch: int) -> int:
    return -(-rows // ubatch)


class Transaction:
    """One request through an arm: prefill, then continuation (speculative or not)."""

    def __init__(self, arm: Arm, target_ctx, draft_ctx=None, k: int = 3, mask: int = 3):
        if k < 1:
            raise ConfigError(f"k (draft proposals per cycle) must be >= 1, got {k}")
        if arm.draft and draft_ctx is None:
            raise ConfigError(f"arm {arm.name} needs a draft model")
        self.arm, self.t, self.d, self.k = arm, target_ctx, draft_ctx, int(k)
        self.guard = PhaseGuard(arm.layout, mask)
        self.c = Counters()

    # -- decode helpers --------------------------------------------------
    def _target(self, tokens, pos0: int) -> list[np.ndarray]:
        """Decode rows on the target under the guard; returns each row's logits."""
        rows = len(tokens)
        with self.guard.scope(self.t, "target") as layout:
            if layout == "GS":  # global serialisation: one row per decode call
                out = []
                for i, tok in enumerate(tokens):
                    self.t.decode([tok], pos0 + i, logits="all")
                    out.append(self.t.logits(0))
                    self.c.target_callers += 1
                    self.c.target_micrographs += 1
                return out
            self.t.decode(tokens, pos0, logits="all")
            self.c.target_callers += 1
            self.c.target_micrographs += _micrographs(rows, self.t.config.n_ubatch)
            if layout in ("PQ", "QB") and rows > 1:
                from .runtime import layouts

                if not layouts.last_admission(self.t).admitted:
                    self.c.layout_not_admitted += 1
            return [self.t.logits(i) for i in range(rows)]

    def _target_prefill(self, tokens) -> np.ndarray:
        with self.guard.scope(self.t, "target") as layout:
            if layout == "GS":
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

    def _draft_prefill(self, tokens) -> None:
        with self.guard.scope(self.d, "draft"):
            n_batch = self.d.config.n_batch
            for s in range(0, len(tokens), n_batch):
                chunk = tokens[s:s + n_batch]
                self.d.decode(chunk, s, logits="none" if s + len(chunk) < len(tokens) else None)
                self.c.draft_callers += 1
        self.guard.phase["draft"] = "continuation"

    def _draft_step(self, tok: int, pos: int) -> int:
        with self.guard.scope(self.d, "draft"):
            self.d.decode([tok], pos)
            self.c.draft_callers += 1
        return self.d.greedy(self.d.logits(-1))

    # -- the request --------------------------------------------------------
    def run(self, prompt_tokens: np.ndarray, cap: int) -> Endpoint:
        cap = check_cap(cap)
        model = self.t.model
        self.guard.new_request()
        self.t.clear()
        toks = np.asarray(prompt_tokens, dtype=np.int32)
        n_past = len(toks)
        if n_past + cap > self.t.n_ctx:
            raise ConfigError(f"prompt ({n_past}) + cap ({cap}) exceed n_ctx={self.t.n_ctx}")
        pending = self.t.greedy(self._target_prefill(toks))
        if self.arm.draft:
            self.d.clear()
            self._draft_prefill(toks)
        out = [pending]

        def done() -> bool:
            return model.is_eog(out[-1]) or len(out) >= cap

        while not done():
            if not self.arm.draft:
                logits = self._target([pending], n_past)[0]
                n_past += 1
                pending = self.t.greedy(logits)
                out.append(pending)
                continue
            k = min(self.k, cap - len(out))
            props, tok = [], pending
            for i in range(k):  # draft: consume pending, then its own proposals
                tok = self._draft_step(tok, n_past + i)
                props.append(tok)
            self.c.proposals += k
            rows = self._target([pending] + props, n_past)
            choices = [self.t.greedy(r) for r in rows]
            m = 0
            while m < k and props[m] == choices[m]:
                m += 1
            self.c.accepted += m
            self.c.cycles += 1
            new = props[:m] + [choices[m]]
            # the target KV holds pending + props[:m]; drop rejected positions
            self.t.seq_rm(0, n_past + m + 1, -1)
            if m < k:
                self.c.rollbacks += 1
                self.d.seq_rm(0, n_past + m + 1, -1)
            else:  # all accepted: the draft has not yet consumed its last proposal
                with self.guard.scope(self.d, "draft"):
                    self.d.decode([props[-1]], n_past + k, logits="none")
                    self.c.draft_callers += 1
            n_past += m + 1
            pending = choices[m]
            for t in new:
                out.append(t)
                if model.is_eog(t) or len(out) >= cap:
                    break
        eog = model.is_eog(out[-1])
        return Endpoint(np.asarray(out, dtype=np.int32), eog, "eog" if eog else "cap")


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

    def record(self) -> dict:
        return {"arm": self.arm, "prompt": self.prompt_id, "seconds": self.seconds, "qualified": self.qualified,
                "first_diff": self.first_diff, "length": self.endpoint.length, "eog": self.endpoint.eog,
                "tokens": [int(t) for t in self.endpoint.tokens], **self.counters.as_dict(), **self.extra}


@dataclass
class SpecConfig:
    k: int = 3
    ubatch: int = 4
    mask: int = 3
    cap: int = 128
    n_ctx: int = 1024
    threads: int = 0
    backend: str = "cpu"
    max_queries: int = 4

    def __post_init__(self):
        check_tokens("k", self.k)
        check_tokens("the target ubatch", self.ubatch)
        check_tokens("n_ctx", self.n_ctx)
        check_threads("the thread count", self.threads)
        check_mask(self.mask)
        check_cap(self.cap)


def check_draft_paths(target_path, draft_path) -> None:
    from .derive import same_vocabulary
    from .models import resolve_model

    ok, why = same_vocabulary(resolve_model(target_path), resolve_model(draft_path))
    if not ok:
        raise IdentityError(f"the draft model does not share the target's vocabulary: {why}")


def check_draft(target_model, draft_model) -> None:
    check_draft_paths(target_model.path, draft_model.path)


class Runner:
    """Owns target and draft models and builds per-arm contexts."""

    def __init__(self, target_model, draft_model=None, cfg: SpecConfig | None = None, vocab_checked: bool = False):
        """vocab_checked: the caller already ran check_draft_paths on these files (before loading)."""
        self.tm, self.dm, self.cfg = target_model, draft_model, cfg or SpecConfig()
        if draft_model is not None and draft_model is not target_model and not vocab_checked:
            check_draft(target_model, draft_model)

    def contexts(self, arm: Arm):
        from .runtime import Context, ContextConfig

        c = self.cfg
        if arm.layout in ("PQ", "QB"):
            from .runtime import layouts

            if not layouts.available():
                raise ConfigError(f"arm {arm.name} needs the attention-layout patch (native/patches/0002)")
        ub = 1 if arm.reference else c.ubatch
        tcfg = ContextConfig(backend=c.backend, n_ctx=c.n_ctx, n_batch=max(512, c.k + 1), n_ubatch=ub,
                             n_threads=c.threads)
        t = Context(self.tm, tcfg)
        if arm.layout in ("PQ", "QB"):
            from .runtime import layouts

            layouts.set_max_queries(t, c.max_queries)
        d = None
        if arm.draft:
            if self.dm is None:
                raise ConfigError(f"arm {arm.name} needs a draft model (--draft)")
            dcfg = ContextConfig(backend=c.backend, n_ctx=c.n_ctx, n_batch=512, n_ubatch=1, n_threads=c.threads)
            d = Context(self.dm, dcfg)
        return t, d

    def run(self, arm_name: str, prompt, warmup: bool = False) -> ArmResult:
        arm = Arm.parse(arm_name)
        t, d = self.contexts(arm)
        try:
            tx = Transaction(arm, t, d, self.cfg.k, self.cfg.mask)
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
        return ArmResult(arm.name, prompt.id, ep, dt, tx.c)


def qualify(results: list[ArmResult]) -> list[ArmResult]:
    """Mark each arm qualified when its complete endpoint equals R's on the same prompt."""
    from .analysis import first_difference

    refs = {r.prompt_id: r for r in results if r.arm == "R"}
    for r in results:
        ref = refs.get(r.prompt_id)
        if ref is None:
            r.qualified = None
            continue
        r.first_diff = first_difference(ref.endpoint.tokens, r.endpoint.tokens)
        r.qualified = r.endpoint.same(ref.endpoint)
    return results
