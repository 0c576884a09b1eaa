"""Prefill schedules and captures.

A schedule is a list of external submissions (chunk sizes, the last may be the rest of
the prompt) and the context's n_ubatch / n_batch, which decide how llama.cpp partitions
each submission internally.  Only the final prompt position requests logits.

Presets (paper section 6.1):
  A  whole prompt in one submission, n_ubatch 512
  B  external split: 128 tokens, then the remainder (n_ubatch 512)
  C  whole prompt, n_ubatch 128 (internal partition)
  R  token by token, n_ubatch 1 (the serial reference)
Explicit schedules: "132+1", "64+64+rest", optionally with "@ubN" (e.g. "128+rest@ub64") or
"ubN" alone (whole prompt, n_ubatch N).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from statelab.errors import ConfigError, one_of
from statelab.kvstate import KVState, MemoryLayout
from statelab.limits import check_tokens
from statelab.mapping import sha256_of
from statelab.runtime import Context, context_identity
from statelab.runtime.native import backend_info

REST = -1
DEFAULT_BATCH = 512


@dataclass(frozen=True)
class Schedule:
    name: str
    chunks: tuple[int, ...] = (REST,)
    n_ubatch: int = 512
    n_batch: int = DEFAULT_BATCH

    def __post_init__(self):
        check_tokens(f"schedule {self.name}: n_ubatch", self.n_ubatch)
        check_tokens(f"schedule {self.name}: n_batch", self.n_batch)
        if self.n_batch < self.n_ubatch:
            raise ConfigError(f"schedule {self.name}: n_batch {self.n_batch} < n_ubatch {self.n_ubatch}")
        if not self.chunks:
            raise ConfigError(f"schedule {self.name}: no submissions")
        for i, c in enumerate(self.chunks):
            if c == REST and i != len(self.chunks) - 1:
                raise ConfigError(f"schedule {self.name}: 'rest' must be the last submission")
            if c != REST:
                check_tokens(f"schedule {self.name}: a submission size", c)

    def submissions(self, n_prompt: int) -> list[int]:
        """Concrete submission sizes for a prompt of n_prompt tokens (never silently changed)."""
        if n_prompt < 1:
            raise ConfigError("the prompt has no tokens")
        fixed = [c for c in self.chunks if c != REST]
        total = sum(fixed)
        if self.chunks[-1] == REST:
            if total >= n_prompt:
                raise ConfigError(
                    f"schedule {self.name}: split point {total} is at or past the prompt length {n_prompt} "
                    f"(no tokens left for the remainder)")
            sizes = fixed + [n_prompt - total]
        else:
            if total != n_prompt:
                raise ConfigError(f"schedule {self.name}: submissions sum to {total} but the prompt has "
                                  f"{n_prompt} tokens")
            sizes = fixed
        big = max(sizes)
        if big > self.n_batch:
            raise ConfigError(f"schedule {self.name}: a submission of {big} tokens exceeds n_batch={self.n_batch}; "
                              f"split the prompt, or form it with statelab's capture/generate, which raise n_batch "
                              "to the largest submission")
        return sizes

    def fitted(self, n_prompt: int) -> "Schedule":
        """The schedule with n_batch raised to its largest submission for a prompt of
        ``n_prompt`` tokens (n_batch only bounds a decode call: the ubatch, which partitions
        the computation, is kept), so A, B, C and R take prompts over 512 tokens."""
        fixed = [c for c in self.chunks if c != REST]
        big = max(fixed + ([n_prompt - sum(fixed)] if self.chunks[-1] == REST else []))
        return replace(self, n_batch=big) if big > self.n_batch else self

    def describe(self) -> str:
        parts = "+".join("rest" if c == REST else str(c) for c in self.chunks)
        return f"{self.name}: [{parts}] ubatch={self.n_ubatch} batch={self.n_batch}"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        return cls(d["name"], tuple(d["chunks"]), int(d["n_ubatch"]), int(d["n_batch"]))


PRESETS = {
    "A": Schedule("A", (REST,), 512),
    "B": Schedule("B", (128, REST), 512),
    "C": Schedule("C", (REST,), 128),
    "R": Schedule("R", (REST,), 1),
}


# what a schedule may be: the message of every refused one and the help of every --schedule option
SCHEDULES_TEXT = f"{one_of(PRESETS)}, or an explicit one such as 132+1, 128+rest@ub64, ub16"


def differing_arms(backend: str) -> dict[str, Schedule]:
    """The presets that form different states on ``backend`` (``runtime.native.Backend.arms``), by name."""
    return {n: PRESETS[n] for n in backend_info(backend).arms}


_EXPLICIT = re.compile(r"^(?:(?P<chunks>(?:\d+|rest)(?:\+(?:\d+|rest))*))?(?:@?ub(?P<ub>\d+))?$")


def parse_schedule(text: str, n_batch: int = DEFAULT_BATCH) -> Schedule:
    """The one parser of schedules: a preset name (:data:`PRESETS`) or an explicit schedule such as 132+1,
    128+rest@ub64, ub16."""
    t = str(text).strip()
    if t in PRESETS:
        return PRESETS[t]
    m = _EXPLICIT.match(t)
    if not t or not m or (m.group("chunks") is None and m.group("ub") is None):
        raise ConfigError(f"unknown schedule {text!r}: use {SCHEDULES_TEXT}")
    chunks = tuple(REST if c == "rest" else int(c) for c in (m.group("chunks") or "rest").split("+"))
    ub = int(m.group("ub")) if m.group("ub") is not None else 512
    if ub == 0:
        raise ConfigError(f"schedule {text!r}: ubatch 0 is not a valid microbatch size")
    return Schedule(t, chunks, ub, max(n_batch, ub))


def partition_sweep(n_prompt: int, splits=(1, 16, 32, 64, 96, 128), ubatches=(1, 2, 4, 8, 16, 32, 64, 128, 512),
                    last_token: bool = True) -> list[Schedule]:
    """The paper's kind of sweep: whole-prompt schedules at several n_ubatch, external splits
    at several points (with the remainder), and the split that leaves one token (n-1 + 1)."""
    out = [Schedule(f"ub{u}", (REST,), u) for u in ubatches]
    pts = sorted({s for s in splits if 0 < s < n_prompt} | ({n_prompt - 1} if last_token and n_prompt > 1 else set()))
    out += [Schedule(f"{s}+rest", (s, REST), 512) for s in pts]
    return out


def paper_sweep(n_prompt: int) -> list[Schedule]:
    """Nineteen schedules of the kinds the paper's partition sweep uses (its Table S9 lists 19;
    the table's body is not in the text this project has, so this is the same kinds, not the
    same list): A, B (128 + rest), C (ubatch 128), R (token by token); whole-prompt submission
    at ubatch 2, 4, 8, 16, 32, 64, 256; external splits 1, 16, 32, 64, 96 and 129 + rest and
    the one that leaves one token (``(n-1)+1``, the paper's 132+1 on a 133-token prompt); and B's
    split at ubatch 64.  Needs n > 130."""
    if n_prompt <= 130:
        raise ConfigError(f"the paper's sweep needs a prompt of more than 130 tokens (129 + rest, n-1 + 1 "
                          f"distinct from it); this one has {n_prompt}")
    out = list(PRESETS.values())
    out += [Schedule(f"ub{u}", (REST,), u, max(DEFAULT_BATCH, u)) for u in (2, 4, 8, 16, 32, 64, 256)]
    out += [Schedule(f"{s}+rest", (s, REST), 512) for s in (1, 16, 32, 64, 96, 129)]
    out += [Schedule("(n-1)+1", (n_prompt - 1, REST), 512), Schedule("128+rest@ub64", (128, REST), 64)]
    return out


@dataclass
class Capture:
    """The state formed by a schedule: the model's view at the end of the prompt."""

    prompt_id: str
    prompt_sha256: str
    tokens: np.ndarray  # int32 prompt tokens
    logits: np.ndarray  # float32 (n_vocab,) initial logits of the last prompt position
    blob: bytes  # llama_state_seq_get_data payload of sequence 0
    schedule: Schedule
    identity: dict  # model/build/backend/device/context configuration
    extra: dict = field(default_factory=dict)

    @property
    def n_prompt(self) -> int:
        return int(len(self.tokens))

    @property
    def layout(self):
        """The model's memory layout recorded with the capture (None for older captures: one KV cache)."""
        rec = self.identity.get("memory")
        return MemoryLayout.from_dict(rec) if isinstance(rec, dict) else None

    @property
    def state(self):
        if "_state" not in self.__dict__:
            self.__dict__["_state"] = KVState.view(self.blob, self.layout)  # read-only views of the blob
        return self.__dict__["_state"]

    def hashes(self) -> dict:
        return {
            "tokens": hashlib.sha256(np.ascontiguousarray(self.tokens, np.int32).tobytes()).hexdigest(),
            "logits": hashlib.sha256(np.ascontiguousarray(self.logits, np.float32).tobytes()).hexdigest(),
            "kv": sha256_of(self.blob),  # streamed (a mapped payload stays unresident)
        }

    def with_blob(self, blob: bytes, **extra) -> "Capture":
        """A copy carrying another KV payload (for crosses), same prompt and logits."""
        return Capture(self.prompt_id, self.prompt_sha256, self.tokens, self.logits, blob, self.schedule,
                       dict(self.identity), {**self.extra, **extra})


def context_config_for(schedule: Schedule, base):
    """The context configuration a schedule runs under (base: a ContextConfig)."""
    return base.with_(n_ubatch=schedule.n_ubatch, n_batch=max(schedule.n_batch, schedule.n_ubatch))


def prefill(ctx, tokens: np.ndarray, schedule: Schedule) -> np.ndarray:
    """Decode the prompt with the schedule's submissions; logits only at the final position."""
    n = len(tokens)
    if n > ctx.n_ctx:
        raise ConfigError(f"the prompt has {n} tokens, more than n_ctx={ctx.n_ctx}")
    pos = 0
    for size in schedule.submissions(n):
        last = pos + size == n
        ctx.decode(tokens[pos:pos + size], pos, logits="none" if not last else None)
        pos += size
    return ctx.logits(-1)


def form(model, prompt, schedule: Schedule, base_config, keep_context: bool = False):
    """Run a schedule on a prompt and capture the resulting state.

    Returns the Capture, or (Capture, Context) with keep_context=True so the caller can
    continue naturally in the forming context.
    """
    tokens = model.tokenize(prompt.text)
    if len(tokens):
        schedule = schedule.fitted(len(tokens))  # n_batch large enough for the largest submission
    config = context_config_for(schedule, base_config)
    if len(tokens) > config.n_ctx:
        raise ConfigError(f"prompt {prompt.id} has {len(tokens)} tokens, more than n_ctx={config.n_ctx}")
    schedule.submissions(len(tokens))  # validate before building a context
    ctx = Context(model, config)
    try:
        logits = prefill(ctx, tokens, schedule)
        cap = Capture(prompt.id, prompt.sha256, tokens, logits, ctx.state_get(), schedule,
                      context_identity(model, config))
    except BaseException:
        ctx.close()
        raise
    if keep_context:
        return cap, ctx
    ctx.close()
    return cap
