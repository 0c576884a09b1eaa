"""Drafters: what proposes the tokens a speculative verify checks, and when proposing pays.

One grammar, one parser: :func:`resolve` turns a drafter text into a :class:`Drafter`
(campaigns, ``spec run`` and ``spec masks`` all go through it); its errors are one line
built from :data:`KINDS`.

  self                          the target model as its own draft
  derive:N                      the target's first N layers (a cached GGUF, ``model derive``)
  PATH.gguf                     another draft model sharing the target's vocabulary
  ngram[:NMIN[-NMAX]][+session] model-free prompt lookup over prompt + output (default n 2-4);
                                ``+session`` also looks up the outputs of the session's
                                earlier requests (a dynamic n-gram cache, as llama.cpp's
                                lookup cache and SuffixDecoding keep)
  none                          no drafter

A drafter only proposes; the target verifies every proposal, so no drafter can change an
output (qualification against R checks it).  :class:`Gate` decides per cycle whether a
proposal is worth its verify rows: from a calibration of the verify cost by rows on the
running device and the drafter's running acceptance for the kind of match it found.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from statelab.errors import ConfigError, DecodeError

# (form, meaning): every message about a drafter text lists these
KINDS = (("self", "the target itself"), ("derive:N", "the target's first N layers"),
         ("PATH.gguf", "a draft model with the target's vocabulary"),
         ("ngram[:NMIN[-NMAX]][+session]", ("model-free prompt lookup, +session also over the session's earlier "
                                            "outputs")),
         ("none", "no drafter"))
NONE = ("", "none")
NGRAM_RE = re.compile(r"^ngram(?::(\d*)(?:-(\d*))?)?(\+session)?$")
NGRAM_DEFAULT = (2, 4)
EXTEND = 64  # how far back two NMAX-long matches (request and session) are compared to pick one


def kinds_text() -> str:
    return "; ".join(f"{form} ({what})" for form, what in KINDS)


def _unknown(text: str, why: str = "") -> ConfigError:
    return ConfigError(f"unknown drafter {text!r}{f' ({why})' if why else ''}; use one of: {kinds_text()}")


def remove_after(ctx, pos: int) -> None:
    """Roll a context's cache back to the positions before ``pos`` (a rejected verify's rows)."""
    if not ctx.seq_rm(0, pos, -1):
        raise DecodeError(f"the KV memory refused to remove positions >= {pos}: a recurrent or hybrid memory "
                          "cannot roll back a speculative verify")


class Drafter:
    """Proposes up to k tokens that would follow the committed history.

    The history is the prompt followed by every committed output token; its last token is
    the pending one (committed, not yet in the target's KV).  `settle` hears how many of the
    proposals the target accepted, so a drafter with its own state can roll back.  `key`
    names the kind of evidence behind the last proposal (an n-gram drafter: where and how
    long its match was), so the gate can keep a running acceptance per kind."""

    text = "?"
    name = "?"
    needs_model = False
    key: object = None

    def start(self, prompt_tokens: np.ndarray) -> None:
        """A new request: the prompt is about to be prefilled."""

    def propose(self, history: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError

    def settle(self, n_past: int, props: np.ndarray, accepted: int) -> None:
        """After verification: `accepted` of `props` (proposed at positions n_past + 1..) were kept."""

    def bind(self, draft_ctx, tx) -> Drafter:
        """The drafter one transaction uses (a model drafter gets its context; others are shared)."""
        return self

    def remember(self, output: np.ndarray) -> None:
        """An earlier request's output of the same session (only session drafters keep it)."""


# -- n-gram lookup ------------------------------------------------------------------------

def suffix_match(corpus: np.ndarray, query: np.ndarray, nmin: int, nmax: int, limit: int) -> tuple[int, int]:
    """(n, j): the longest n in [nmin, nmax] such that the last n tokens of ``query`` occur in
    ``corpus`` ending at some j < ``limit``, and the end j of the most recent such occurrence;
    (0, -1) when none does.  Grown one token to the left at a time over the candidate ends
    (vectorised); tokens < 0 in the corpus (separators) never match."""
    if limit < 1 or len(query) < 1:
        return 0, -1
    ends = np.flatnonzero(corpus[:limit] == query[-1])
    ends = ends[corpus[ends + 1] >= 0]  # a continuation exists (not a separator)
    best = (1, int(ends[-1])) if nmin == 1 and len(ends) else (0, -1)
    q = len(query) - 1
    for n in range(2, min(nmax, len(query)) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[corpus[ends - (n - 1)] == query[q - (n - 1)]]
        if not len(ends):
            break
        if n >= nmin:
            best = (n, int(ends[-1]))
    return best


def parse_ngram(draft: str) -> tuple[int, int]:
    """'ngram' -> the default range; 'ngram:N' -> (N, N); 'ngram:NMIN-NMAX' (a '+session' tail allowed)."""
    return _ngram(draft)[:2]


def _ngram(draft: str) -> tuple[int, int, bool]:
    m = NGRAM_RE.match(str(draft).strip())
    if not m or m.group(1) == "" or m.group(2) == "":
        raise ConfigError(f"bad n-gram drafter {draft!r}; use ngram, ngram:N or ngram:NMIN-NMAX (e.g. ngram:2-4), "
                          "optionally with +session")
    session = m.group(3) is not None
    if m.group(1) is None:
        return (*NGRAM_DEFAULT, session)
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if not 1 <= lo <= hi <= 64:
        raise ConfigError(f"n-gram range {draft!r} must satisfy 1 <= NMIN <= NMAX <= 64")
    return lo, hi, session


def is_ngram(draft) -> bool:
    return isinstance(draft, str) and draft.startswith("ngram")


class NgramDrafter(Drafter):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the last
    n tokens of the history (prompt + output so far), longest n first (NMAX down to NMIN).
    With ``session``, the outputs of the session's earlier requests (:meth:`remember`) are a
    second corpus: the longer match of the two wins (when both reach NMAX, the one that also
    matches further back, up to 64 tokens; the request's own history on a tie).  The key of a
    proposal (source, n) counts n only up to NMAX.
    No model: a proposal is a few vectorised comparisons."""

    def __init__(self, nmin: int = NGRAM_DEFAULT[0], nmax: int = NGRAM_DEFAULT[1], session: bool = False):
        if not 1 <= nmin <= nmax:
            raise ConfigError(f"n-gram range needs 1 <= NMIN <= NMAX, got {nmin}-{nmax}")
        self.nmin, self.nmax, self.session = int(nmin), int(nmax), bool(session)
        self.name = self.text = f"ngram:{self.nmin}-{self.nmax}" + ("+session" if session else "")
        self.corpus = np.empty(0, dtype=np.int32)  # earlier outputs, each followed by a -1 separator
        self.key = None

    def remember(self, output) -> None:
        if self.session:
            out = np.asarray(output, dtype=np.int32)
            self.corpus = np.concatenate([self.corpus, out, np.asarray([-1], dtype=np.int32)])

    def forget(self) -> None:
        self.corpus = self.corpus[:0]

    def match(self, history: np.ndarray) -> tuple[int, int]:
        """(n, j) in the request's own history (j < len - 1); (0, -1) when nothing matched."""
        return suffix_match(history, history, self.nmin, self.nmax, len(history) - 1)

    def propose(self, history: np.ndarray, k: int) -> np.ndarray:
        self.key = None
        if k < 1:
            return history[:0]
        n, j = self.match(history)
        src = history
        if self.session and len(self.corpus):
            ns, js = suffix_match(self.corpus, history, self.nmin, self.nmax, len(self.corpus) - 1)
            if ns == n == self.nmax:  # both as long as NMAX: the one that matches further back wins
                n, j = suffix_match(history, history, n, EXTEND, len(history) - 1)
                ns, js = suffix_match(self.corpus, history, ns, EXTEND, len(self.corpus) - 1)
            if ns > n:
                n, j, src = ns, js, self.corpus
        if n == 0:
            return history[:0]
        props = src[j + 1:j + 1 + k]
        if src is self.corpus:
            cut = np.flatnonzero(props < 0)
            props = props[:cut[0]] if len(cut) else props
        self.key = ("session" if src is self.corpus else "request", min(n, self.nmax))
        return props


# -- draft models ---------------------------------------------------------------------------

class ModelDrafter(Drafter):
    """A draft model (the target itself, a derived truncation or another GGUF) with its own
    context: it consumes the pending token, then its own greedy proposals; rejected positions
    are removed from its cache.  Unbound (``path``: the model file, None: the target) until
    :meth:`bind` gives it a transaction's draft context."""

    needs_model = True

    def __init__(self, path: str | None = None, ctx=None, tx=None, text: str = "self"):
        self.path, self.d, self.tx = path, ctx, tx
        self.text = text
        self.name = "model"
        self.key = "model"

    def bind(self, draft_ctx, tx) -> ModelDrafter:
        return ModelDrafter(self.path, draft_ctx, tx, self.text)

    def start(self, prompt_tokens: np.ndarray) -> None:
        tx = self.tx
        self.d.clear()
        with tx.guard.scope(self.d, "draft"):
            n_batch = self.d.config.n_batch
            for s in range(0, len(prompt_tokens), n_batch):
                chunk = prompt_tokens[s:s + n_batch]
                self.d.decode(chunk, s, logits="none" if s + len(chunk) < len(prompt_tokens) else None)
                tx.c.draft_callers += 1
        tx.guard.phase["draft"] = "continuation"

    def propose(self, history: np.ndarray, k: int) -> np.ndarray:
        tx, pos = self.tx, len(history) - 1
        props = np.empty(k, dtype=np.int32)
        tok = int(history[-1])
        for i in range(k):  # consume pending, then its own proposals
            with tx.guard.scope(self.d, "draft"):
                self.d.decode([tok], pos + i)
                tx.c.draft_callers += 1
            tok = props[i] = self.d.greedy_row(-1)
        return props

    def settle(self, n_past: int, props: np.ndarray, accepted: int) -> None:
        k = len(props)
        if accepted < k:
            remove_after(self.d, n_past + accepted + 1)
        elif k:  # all accepted: the draft has not yet consumed its last proposal
            with self.tx.guard.scope(self.d, "draft"):
                self.d.decode(props[-1:], n_past + k, logits="none")
                self.tx.c.draft_callers += 1


# -- the grammar ------------------------------------------------------------------------------

def check(text: str | None) -> str | None:
    """The drafter text checked without side effects (no model derived, no file read but its
    existence); None for no drafter.  Raises one line built from :data:`KINDS`."""
    if text is None or str(text).strip() in NONE:
        return None
    t = str(text).strip()
    if t == "self":
        return t
    if t.startswith("ngram"):
        lo, hi, session = _ngram(t)
        return f"ngram:{lo}-{hi}" + ("+session" if session else "")
    if t.startswith("derive:"):
        arg = t.split(":", 1)[1]
        if not arg.isdigit() or int(arg) < 1:
            raise _unknown(t, "derive:N needs a layer count N >= 1, e.g. derive:8")
        return t
    if t.endswith(".gguf") or Path(t).is_file():
        if not Path(t).is_file():
            raise ConfigError(f"draft model not found: {t}")
        return t
    raise _unknown(t)


def resolve(text: str | None, target=None, cache_dir: Path | None = None) -> Drafter | None:
    """A drafter text -> its :class:`Drafter` (None for ``none``).  ``target``: the target
    model (a GGUF path, a loaded model, or None for the embedded one): ``self`` drafts with
    it, ``derive:N`` derives (once, cached) its first N layers, and a GGUF path must share its
    vocabulary.  The drafter's ``text`` is its resolved form (a derived draft's path), which
    resolves again cheaply in a worker process."""
    t = check(text)
    if t is None:
        return None
    if t.startswith("ngram"):
        return NgramDrafter(*_ngram(t))
    if t == "self":
        return ModelDrafter(None, text="self")
    from statelab.models import model_sha256, resolve_model

    tpath = resolve_model(getattr(target, "path", target))
    if t.startswith("derive:"):
        from statelab.paths import cache_dir as default_cache
        from statelab.speculative.derive import derive_truncated

        n = int(t.split(":", 1)[1])
        out = (cache_dir or default_cache()) / "drafts" / f"{model_sha256(tpath)[:16]}-first{n}.gguf"
        if not out.exists():
            derive_truncated(tpath, out, n)
        return ModelDrafter(str(out), text=str(out))
    check_vocabulary(tpath, t)
    return ModelDrafter(t, text=t)


def check_vocabulary(target_path, draft_path) -> None:
    """A draft model must share the target's vocabulary (read from both headers, nothing loaded)."""
    from statelab.errors import IdentityError
    from statelab.models import resolve_model
    from statelab.speculative.derive import same_vocabulary

    ok, why = same_vocabulary(resolve_model(target_path), resolve_model(draft_path))
    if not ok:
        raise IdentityError(f"the draft model does not share the target's vocabulary: {why}")


# -- when proposing pays ------------------------------------------------------------------------

SPAN = 4  # calls a new verify shape is expected to last (the gate spreads a shape change's extra over them)


@dataclass(frozen=True)
class VerifyCosts:
    """Seconds of one verify call by rows (index r - 1 for r rows): ``same`` when the previous
    call had the same shape (llama.cpp reuses the graph), ``change`` when it had another (the
    graph is rebuilt).  Measured on the running device (:func:`~statelab.speculative.
    transaction.measure_verify_costs`), never assumed."""
    same: tuple[float, ...]
    change: tuple[float, ...]

    def __post_init__(self):
        if not self.same or len(self.same) != len(self.change) or min(self.same + self.change) <= 0:
            raise ConfigError("verify costs need a positive time for every row count 1..R, same and changing shape")

    @property
    def rows(self) -> int:
        return len(self.same)

    def cost(self, rows: int, prev_rows: int) -> float:
        """What a call of ``rows`` rows costs after a call of ``prev_rows`` (0: none yet): its
        same-shape cost, plus the extra of a shape change spread over the SPAN calls that the
        new shape is expected to last (so a gate neither thrashes between shapes nor stays
        in a dear shape for ever because leaving it once costs more)."""
        same = self.same[rows - 1]
        if prev_rows and rows != prev_rows:
            return same + (self.change[rows - 1] - same) / SPAN
        return same

    def as_dict(self) -> dict:
        return {"same": list(self.same), "change": list(self.change)}

    @classmethod
    def from_dict(cls, d: dict) -> VerifyCosts:
        return cls(tuple(float(x) for x in d["same"]), tuple(float(x) for x in d["change"]))


@dataclass
class Gate:
    """Propose only when the expected gain is positive.

    A cycle without proposals decodes the pending token alone (one row; with a fixed verify
    shape, the padded call instead when that is cheaper than changing shape).  A proposal of
    p tokens from evidence `key` is expected to keep a^1 + ... + a^p of them, a the running
    probability that the next proposed token is accepted given the previous ones were
    (accepted / (accepted + rejections) per key, this request only, from optimistic
    pseudo-counts 3:1, so a kind of match is tried until its own record turns it off).  It
    is submitted (cut to its best length when rows follow it) only when expected kept tokens
    x the one-row cost exceed the extra cost of its verify over the no-proposal cycle."""
    costs: VerifyCosts
    prior: tuple[float, float] = (3.0, 1.0)  # pseudo-counts (accepted, rejected): optimistic, so every kind of
    # match is tried in each request until its own evidence says it does not pay
    stats: dict = field(default_factory=dict)
    declined: int = 0

    def start(self) -> None:
        self.stats = {}

    def acceptance(self, key) -> float:
        a, r = self.stats.get(key, (0, 0))
        return (a + self.prior[0]) / (a + r + self.prior[0] + self.prior[1])

    def wants_proposal(self, hist: np.ndarray, L: int) -> bool:
        """Whether this cycle needs the drafter's proposal (every cycle: the gain gate weighs each)."""
        return True

    def is_plain(self) -> bool:
        """Whether the gate is in a regime of one-row decodes (the gain gate weighs every cycle: never)."""
        return False

    def plain(self, prev_rows: int, fixed_rows: int | None) -> tuple[int, float]:
        """(rows, seconds) of the cheapest cycle without proposals."""
        one = self.costs.cost(1, prev_rows)
        if fixed_rows and fixed_rows <= self.costs.rows:
            padded = self.costs.cost(fixed_rows, prev_rows)
            if padded < one:
                return fixed_rows, padded
        return 1, one

    def choose(self, key, props: np.ndarray, hist: np.ndarray, L: int, prev_rows: int,
               fixed_rows: int | None) -> int:
        """How many of the drafter's proposals ``props`` to submit (0: none); ``hist[:L]`` is
        the committed history (this gate does not read it)."""
        p = len(props)
        if p < 1:
            return 0
        a = self.acceptance(key)
        kept = np.cumsum(a ** np.arange(1, p + 1))  # expected kept tokens for 1..p proposals
        _, base = self.plain(prev_rows, fixed_rows)
        one = self.costs.same[0]
        if fixed_rows:
            rows = np.full(p, min(fixed_rows, self.costs.rows))
        else:
            rows = np.minimum(np.arange(2, p + 2), self.costs.rows)
        extra = np.array([self.costs.cost(int(r), prev_rows) for r in rows]) - base
        gain = kept * one - extra
        best = int(np.argmax(gain))
        if gain[best] <= 0:
            self.declined += 1
            return 0
        return best + 1

    def update(self, key, proposed: int, accepted: int, rows: int = 0, prev_rows: int = 0,
               seconds: float = 0.0) -> None:
        """After a cycle: ``accepted`` of ``proposed`` kept, in a call of ``rows`` rows after one of
        ``prev_rows`` that took ``seconds`` of wall time (this gate uses only the counts)."""
        if proposed < 1:
            return
        a, r = self.stats.get(key, (0, 0))
        self.stats[key] = (a + accepted, r + (accepted < proposed))


@dataclass
class ShadowGate:
    """Draft in runs, and judge each run by what drafting would have committed.

    Two regimes.  *Drafting*: every proposal is submitted (with a fixed verify shape, every
    call has its rows, so the graph is reused).  *Plain*: one-row decodes, no proposal.  In
    both the gate keeps one figure, the running mean (half-life ``half_life`` cycles) of the
    tokens a drafting cycle commits (1 + accepted).  While drafting it is what the target
    accepted; while plain it is measured in the shadow: the drafter still proposes, the
    proposal is not submitted, and the following one-row decodes tell how much of it the
    target would have accepted (a shadow cycle ends where a drafting cycle would have ended,
    at the first disagreement or at the proposal's end, and the next shadow proposal starts
    there, as the next drafting cycle would).  So the estimate of a regime never rests on a
    prior that its own record cannot correct, and it costs one proposal per shadow cycle.

    The regime changes when drafting's tokens per second (mean tokens / a drafting cycle's
    seconds) and plain's (1 / a plain cycle's seconds) differ by more than ``margin``, at most
    once in ``dwell`` cycles (each change of verify shape is a graph rebuild).  A cycle's
    seconds start from the calibration (:class:`VerifyCosts`: the call, measured after two
    warm-up calls of its shape) and follow the measured wall time of the regime's cycles (the
    host work of a cycle included) from the third call of a shape on: the first calls after a
    change pay the graph's rebuild and, on CUDA, the capture of its CUDA graph (ggml-cuda
    captures on the second call of a stable shape), which the shape change's cost already
    counts.  A sample counts at most twice the running figure (one stall does not flip the
    regime).  A request starts drafting with ``prior`` tokens per cycle (plain with
    ``start_drafting`` False: with an endless ``dwell``, a gate held plain)."""
    costs: VerifyCosts
    half_life: float = 8.0
    margin: float = 0.05
    dwell: int = 8
    prior: float = 2.0
    declined: int = 0
    drafting: bool = True
    tokens: float = 2.0
    since: int = 0
    shadow: tuple | None = None
    seconds: dict = field(default_factory=dict)
    fixed_rows: int | None = None
    run: int = 0  # calls in a row with the current shape
    start_drafting: bool = True

    WARM = 3  # the first call of a shape whose time counts (after the rebuild and the CUDA graph capture)

    def start(self) -> None:
        self.drafting, self.tokens, self.since, self.shadow, self.run = self.start_drafting, float(self.prior), 0, None, 0
        self.seconds = {}

    def _cycle_seconds(self, drafting: bool) -> float:
        c = self.costs
        if not drafting:
            default = c.same[0]
        elif self.fixed_rows:
            default = c.same[min(self.fixed_rows, c.rows) - 1]
        else:  # rows follow the proposal: most calls change shape
            default = float(np.mean(c.change[1:] or c.change))
        return self.seconds.get(drafting, default)

    def _feed(self, tokens: int) -> None:
        w = 1.0 - 0.5 ** (1.0 / self.half_life)
        self.tokens += w * (tokens - self.tokens)
        if self.since < self.dwell:
            return
        breakeven = self._cycle_seconds(True) / self._cycle_seconds(False)
        if self.drafting and self.tokens < breakeven * (1 - self.margin):
            self.drafting, self.since, self.shadow = False, 0, None
        elif not self.drafting and self.tokens > breakeven * (1 + self.margin):
            self.drafting, self.since, self.shadow = True, 0, None

    def _settle_shadow(self, hist: np.ndarray, L: int) -> bool:
        """Resolve the pending shadow proposal against ``hist[:L]``; False while it is open."""
        L0, sp = self.shadow
        n = min(L - L0, len(sp))
        agree = sp[:n] == hist[L0:L0 + n]
        if agree.all() and n < len(sp):
            return False
        self.shadow = None
        self._feed(1 + (n if agree.all() else int(np.argmin(agree))))
        return True

    def wants_proposal(self, hist: np.ndarray, L: int) -> bool:
        """False while plain with a shadow proposal still open against ``hist[:L]`` (it is
        settled here): nothing would use a new proposal, so the drafter is not asked.  Until it
        disagrees or ends, every cycle is a one-row decode; the transaction runs the plain
        regime as one loop of R's step (:meth:`~statelab.speculative.transaction.Transaction._plain_run`),
        asking for the next shadow proposal there."""
        return self.drafting or self.shadow is None or self._settle_shadow(hist, L)

    def is_plain(self) -> bool:
        """Plain: every cycle a one-row decode, the drafter asked only for the shadow proposals."""
        return not self.drafting

    def choose(self, key, props: np.ndarray, hist: np.ndarray, L: int, prev_rows: int,
               fixed_rows: int | None) -> int:
        """Drafting: all of ``props``; plain: none (the proposal becomes the shadow one when no
        shadow proposal is open).  ``hist[:L]``: the committed history."""
        self.fixed_rows = fixed_rows
        if self.shadow is not None and not self._settle_shadow(hist, L):
            return 0
        if self.drafting:
            return len(props)
        if len(props):
            self.shadow = (L, np.array(props, copy=True))
            self.declined += 1
        else:
            self._feed(1)  # a drafting cycle without a proposal commits its one token
        return 0

    def plain(self, prev_rows: int, fixed_rows: int | None) -> tuple[int, float]:
        """(rows, seconds) of a cycle without proposals: the fixed shape while drafting, one row
        otherwise."""
        if self.drafting and fixed_rows and fixed_rows <= self.costs.rows:
            return fixed_rows, self.costs.same[fixed_rows - 1]
        return 1, self.costs.same[0]

    def update(self, key, proposed: int, accepted: int, rows: int = 0, prev_rows: int = 0,
               seconds: float = 0.0) -> None:
        """After a cycle of ``rows`` rows (after one of ``prev_rows``) that took ``seconds``."""
        was = self.drafting
        self.since += 1
        self.run = self.run + 1 if rows == prev_rows else 1
        if seconds > 0 and self.run >= self.WARM:  # a warm call of a stable shape: the regime's own cost
            w = 1.0 - 0.5 ** (1.0 / self.half_life)
            s = self.seconds.get(was)
            self.seconds[was] = seconds if s is None else s + w * (min(seconds, 2 * s) - s)
        if was:
            self._feed(1 + accepted)


GATES = {"gain": Gate, "shadow": ShadowGate}  # the campaign field ``gate`` (true: "gain") and ``spec run --gate``


def check_gate(kind) -> str | None:
    """The name of a gate kind (``"gain"``, ``"shadow"``; True: ``"gain"``; False/None: None), or a one-line refusal."""
    if kind is False or kind is None:
        return None
    name = "gain" if kind is True else kind
    if not isinstance(name, str) or name not in GATES:
        raise ConfigError(f"unknown gate {kind!r}; use one of: {', '.join(GATES)} (or true / false)")
    return name


def make_gate(kind, costs: VerifyCosts):
    """The gate of a kind (:func:`check_gate`) over calibrated costs; None for no gate."""
    name = check_gate(kind)
    return None if name is None else GATES[name](costs)
