"""Natural endpoints, shams, whole-KV crosses and subset crosses, with byte accounting."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, fields

import numpy as np

from statelab.errors import DecodeError, IdentityError
from statelab.kvstate import compare
from statelab.lab.archive import check_importable
from statelab.lab.formation import Capture, form
from statelab.lab.receiver import DEFAULT_CAP, Endpoint, check_cap, continue_greedy
from statelab.runtime import Context, ContextConfig
from statelab.selection import subset_payload


def config_of(capture: Capture):
    """The recipient path's context configuration, as recorded in the capture."""
    c = capture.identity["context"]
    return ContextConfig(**{f.name: c[f.name] for f in fields(ContextConfig) if f.name in c})


def natural(model, prompt, schedule, base_config, cap: int = DEFAULT_CAP, trace: bool = False):
    """Form the state with `schedule` and continue in the forming context."""
    check_cap(cap)
    capture, ctx = form(model, prompt, schedule, base_config, keep_context=True)
    with ctx:
        ep = continue_greedy(ctx, capture.logits, capture.n_prompt, cap, trace)
    return capture, ep


@dataclass
class ImportAccount:
    """What an import put into the recipient: selected bytes, bytes that actually changed, distances."""

    selected_bytes: int
    changed_bytes: int
    total_value_bytes: int
    max_abs: float
    l2: float
    l2_rel: float
    first_differing_layer: int | None
    verified: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def import_and_continue(model, config, blob: bytes, logits0: np.ndarray, n_prompt: int, cap: int,
                        trace: bool = False, contexts=None, follow=None, timing: dict | None = None) -> Endpoint:
    """The common receiver with read-back verification: the imported state must read back
    byte for byte before any token is decoded.  ``contexts`` (a ``runtime.ContextPool``):
    decode in the pool's cleared context for ``config`` instead of a new one.  ``follow``
    (tokens): stop at the first output that leaves them (``continue_greedy``).  ``timing``: a
    dict that receives the seconds of the context (``context_s``), of the import with its
    read-back (``import_s``) and of the decoding (``decode_s``)."""
    t0 = time.perf_counter()
    if not np.all(np.isfinite(logits0)):
        raise DecodeError("the capture has no initial logits (a state imported without them): import it again "
                          "with --logits recompute")
    with (nullcontext(contexts.get(config)) if contexts is not None else Context(model, config)) as ctx:
        t1 = time.perf_counter()
        ctx.state_set(blob)
        if not ctx.state_matches(blob):
            raise DecodeError("the state read back after import differs from the imported payload")
        got = ctx.seq_pos_max(0)
        if got != n_prompt - 1:
            raise DecodeError(f"restored state ends at position {got}, expected {n_prompt - 1}")
        t2 = time.perf_counter()
        ep = continue_greedy(ctx, logits0, n_prompt, cap, trace, follow=follow)
        if timing is not None:
            timing.update(context_s=t1 - t0, import_s=t2 - t1, decode_s=time.perf_counter() - t2)
        return ep


def sham(model, capture: Capture, cap: int = DEFAULT_CAP, trace: bool = False,
         allow_other_backend: bool = False) -> Endpoint:
    """A capture restored into its own path; must reproduce the natural endpoint."""
    config = config_of(capture)
    check_importable(capture, model, config, allow_other_backend)
    return import_and_continue(model, config, capture.blob, capture.logits, capture.n_prompt, check_cap(cap), trace)


def _same_prompt(a: Capture, b: Capture) -> None:
    ma, mb = a.identity.get("model_sha256"), b.identity.get("model_sha256")
    if ma != mb:
        raise IdentityError(f"donor ({a.prompt_id}) was formed with model {str(ma)[:12]}…, recipient "
                            f"({b.prompt_id}) with model {str(mb)[:12]}…: a state does not cross models")
    if a.prompt_sha256 != b.prompt_sha256 or not np.array_equal(a.tokens, b.tokens):
        raise IdentityError(f"donor ({a.prompt_id}) and recipient ({b.prompt_id}) were formed on different prompts")


def account(recipient_state, new_state, selected_bytes: int, verified: bool) -> ImportAccount:
    d = compare(recipient_state, new_state, reference=recipient_state)
    return ImportAccount(selected_bytes, int(d.changed_bytes), int(recipient_state.value_nbytes),
                         float(d.max_abs), float(d.l2), float(d.l2_rel), d.first_differing_layer, verified)


def check_pair(model, donor: Capture, recipient: Capture, allow_other_backend: bool = False):
    """The checks of every cross: one model and one prompt, and the donor's state importable
    into the recipient's path (raises IdentityError / ArchiveError); the recipient's config."""
    _same_prompt(donor, recipient)
    config = config_of(recipient)
    check_importable(donor, model, config, allow_other_backend)
    return config


def cross(model, donor: Capture, recipient: Capture, logits_from: str = "recipient", cap: int = DEFAULT_CAP,
          trace: bool = False, allow_other_backend: bool = False):
    """Whole-KV cross: the donor's KV in the recipient's path; logits from `logits_from`."""
    if logits_from not in ("recipient", "donor"):
        raise IdentityError(f"logits_from must be 'recipient' or 'donor', got {logits_from!r}")
    config = check_pair(model, donor, recipient, allow_other_backend)
    logits = recipient.logits if logits_from == "recipient" else donor.logits
    ep = import_and_continue(model, config, donor.blob, logits, recipient.n_prompt, check_cap(cap), trace)
    acc = account(recipient.state, donor.state, int(recipient.state.value_nbytes), True)
    return ep, acc


def subset_cross(model, donor: Capture, recipient: Capture, selection, cap: int = DEFAULT_CAP,
                 trace: bool = False, allow_other_backend: bool = False, contexts=None, follow=None,
                 timing: dict | None = None, payload=None):
    """Only the selected bytes come from the donor; the recipient keeps its initial logits.
    ``contexts``, ``follow`` and ``timing`` as in :func:`import_and_continue`; ``timing``
    also gets the seconds of mixing the payload (``mix_s``) and of the byte account
    (``account_s``).  ``payload``: ``subset_payload(recipient.state, donor.state, selection)``
    made by the caller (a study cell names its cross by the bytes it imports), else made here."""
    config = check_pair(model, donor, recipient, allow_other_backend)
    t0 = time.perf_counter()
    # the one copy of the state a cross makes
    blob, mixed = payload if payload is not None else subset_payload(recipient.state, donor.state, selection)
    t1 = time.perf_counter()
    ep = import_and_continue(model, config, blob, recipient.logits, recipient.n_prompt, check_cap(cap), trace,
                             contexts, follow, timing)
    t2 = time.perf_counter()
    acc = account(recipient.state, mixed, int(selection.selected_bytes), True)
    if timing is not None:
        timing.update(mix_s=t1 - t0, account_s=time.perf_counter() - t2)
    return ep, acc
