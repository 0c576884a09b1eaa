"""The common receiver: after KV + positions are restored (intervene.import_and_continue,
with read-back verification), consume the captured FP32 logits with the native greedy
sampler (the first generated token is pending, not yet in KV), decode it exactly once at
position n_prompt, continue to the output cap or end of generation."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from statelab.errors import ConfigError

DEFAULT_CAP = 128


@dataclass
class Endpoint:
    tokens: np.ndarray  # int32 generated token ids (the EOG token, when reached, is the last one)
    eog: bool
    stop_reason: str  # "eog" | "cap" | "ctx" | "left" (left the followed tokens: continue_greedy)
    trace: np.ndarray | None = field(default=None, repr=False)  # (len, n_vocab) float32: logits of each output

    @property
    def length(self) -> int:
        return int(len(self.tokens))

    @property
    def last_token(self) -> int | None:
        return int(self.tokens[-1]) if len(self.tokens) else None

    def same(self, other: "Endpoint") -> bool:
        return self.eog == other.eog and np.array_equal(self.tokens, other.tokens)

    def as_dict(self) -> dict:
        return {"tokens": [int(t) for t in self.tokens], "eog": self.eog, "length": self.length,
                "last_token": self.last_token, "stop_reason": self.stop_reason}

    @classmethod
    def from_dict(cls, d: dict) -> "Endpoint":
        return cls(np.asarray(d["tokens"], dtype=np.int32), bool(d["eog"]), d["stop_reason"])


def check_cap(cap: int) -> int:
    if not isinstance(cap, (int, np.integer)) or cap < 1:
        raise ConfigError(f"the output cap must be a positive integer, got {cap!r}")
    return int(cap)


def continue_greedy(ctx, logits0: np.ndarray, n_past: int, cap: int = DEFAULT_CAP, trace: bool = False,
                    on_token=None, follow=None) -> Endpoint:
    """Greedy continuation from available logits with n_past positions already in KV.

    ``follow`` (tokens): stop as soon as an output differs from the followed token at its
    index or runs past them (stop reason ``left``, checked before EOG: an output that leaves on
    an EOG token is ``left`` with ``eog`` False): the endpoint is then known to differ from the
    followed one (an oracle that only asks "the same endpoint?" need not decode further)."""
    cap = check_cap(cap)
    follow = None if follow is None else np.asarray(follow, dtype=np.int32)

    def left(n: int) -> bool:  # the n-th output (1-based) is not the followed one
        return follow is not None and (n > len(follow) or out[n - 1] != follow[n - 1])

    model = ctx.model
    rows = [np.asarray(logits0, dtype=np.float32)] if trace else None
    tok = ctx.greedy(logits0)
    out = [tok]
    stop = "cap"
    while True:
        if left(len(out)):
            stop = "left"
            break
        if model.is_eog(tok):
            stop = "eog"
            break
        if len(out) >= cap:
            break
        if n_past >= ctx.n_ctx:
            stop = "ctx"
            break
        ctx.decode([tok], n_past)  # the pending token enters KV exactly once
        n_past += 1
        if trace:
            lg = ctx.logits(-1)
            rows.append(lg)
            tok = ctx.greedy(lg)
        else:
            tok = ctx.greedy_row(-1)
        out.append(tok)
        if on_token is not None:
            on_token(len(out))
    return Endpoint(np.asarray(out, dtype=np.int32), stop == "eog", stop,
                    np.stack(rows) if trace else None)

