"""Per-prompt controls, run once before any cell (paper S5.1: EMPTY/ALL controls pass before
the subset requests).

For every arm: form the capture once (natural schedule, continued in its forming context:
the natural endpoint), archive it and read it back verified, and restore it into its own
path (the sham, which must equal the natural endpoint).  For every direction: the EMPTY
subset cross must reproduce the recipient's natural endpoint and change no byte; the ALL
subset cross must build exactly the donor's payload and equal the whole-KV cross with
recipient logits.  A failed control withholds all of that prompt's cells.
"""
from __future__ import annotations

import time

from statelab.analysis.classes import endpoint_class, first_difference
from statelab.kvstate import compare
from statelab.lab.archive import load_capture, save_capture
from statelab.lab.intervene import cross, natural, sham, subset_cross
from statelab.lab.receiver import Endpoint
from statelab.selection import Selector, Term, apply_subset, select

EMPTY = Selector("EMPTY", (), "control: nothing")
ALL = Selector("ALL", (Term(),), "control: every K/V value")


def _fd(a: Endpoint, b: Endpoint) -> int | None:
    """First differing output (None: equal).  The EOG flag follows from the tokens (the
    receiver stops at the first EOG token), so equal tokens mean equal endpoints."""
    return first_difference(a.tokens, b.tokens)


def run_controls(model, spec, prompt, sdir, base) -> dict:
    t0 = time.perf_counter()
    rec = {"prompt": prompt.id, "prompt_sha256": prompt.sha256, "spec_hash": spec.hash, "arms": {},
           "directions": {}, "reasons": []}
    caps, nats = {}, {}
    for arm, sched in spec.arms.items():
        capture, ep = natural(model, prompt, sched, base, spec.cap)
        dest = sdir.capture_dir(prompt.id, arm)
        save_capture(capture, dest, overwrite=True)
        loaded = load_capture(dest)  # verified against its manifest
        archive_ok = loaded.hashes() == capture.hashes()
        sh = sham(model, loaded, spec.cap)
        sham_ok = sh.same(ep)
        caps[arm], nats[arm] = loaded, ep
        rec["n_prompt"] = capture.n_prompt
        rec["arms"][arm] = {
            "schedule": sched.describe(), "capture": str(dest.relative_to(sdir.root)), **capture.hashes(),
            "natural": ep.as_dict(), "sham": sh.as_dict(), "sham_ok": sham_ok,
            "sham_first_diff": _fd(sh, ep), "archive_ok": archive_ok,
        }
        if not archive_ok:
            rec["reasons"].append(f"arm {arm}: the archived capture does not read back identically")
        if not sham_ok:
            rec["reasons"].append(f"arm {arm}: sham differs from the natural endpoint at output {_fd(sh, ep)}")

    arms = list(spec.arms)
    ref = arms[0]
    rec["arm_pairs"] = {}
    for other in arms[1:]:
        d = compare(caps[ref].state, caps[other].state, reference=caps[ref].state)
        rec["arm_pairs"][f"{ref}/{other}"] = {
            "reference": ref, "other": other, "kv_identical": d.identical, "changed_bytes": d.changed_bytes,
            "max_abs": d.max_abs, "l2": d.l2, "ref_l2": d.ref_l2, "l2_rel": d.l2_rel,
            "first_differing_layer": d.first_differing_layer,
            "logits_equal": caps[ref].logits.tobytes() == caps[other].logits.tobytes(),
            "natural_first_diff": _fd(nats[ref], nats[other]),
            "natural_same": nats[ref].same(nats[other]),
        }

    for direc in spec.directions:
        donor, recip = caps[direc.donor], caps[direc.recipient]
        nd, nr = nats[direc.donor], nats[direc.recipient]
        e_sel = select(EMPTY, recip.state)
        ep_e, acc_e = subset_cross(model, donor, recip, e_sel, spec.cap)
        empty_ok = ep_e.same(nr) and acc_e.changed_bytes == 0 and e_sel.selected_bytes == 0
        a_sel = select(ALL, recip.state)
        mixed_is_donor = apply_subset(recip.state, donor.state, a_sel).to_bytes() == donor.blob
        ep_a, acc_a = subset_cross(model, donor, recip, a_sel, spec.cap)
        ep_w, acc_w = cross(model, donor, recip, "recipient", spec.cap)
        all_ok = ep_a.same(ep_w) and mixed_is_donor and acc_a.changed_bytes == acc_w.changed_bytes
        rec["directions"][direc.label] = {
            "donor": direc.donor, "recipient": direc.recipient,
            "donor_distinguishable": not nd.same(nr),
            "empty": {"endpoint": ep_e.as_dict(), "ok": empty_ok, "changed_bytes": acc_e.changed_bytes,
                      "first_diff_recipient": _fd(ep_e, nr)},
            "all": {"endpoint": ep_a.as_dict(), "ok": all_ok, "mixed_equals_donor": mixed_is_donor,
                    "selected_bytes": a_sel.selected_bytes, "changed_bytes": acc_a.changed_bytes,
                    "first_diff_whole_cross": _fd(ep_a, ep_w),
                    "klass": endpoint_class(ep_a, nd, nr)},
            "whole_cross": {"endpoint": ep_w.as_dict(), "klass": endpoint_class(ep_w, nd, nr),
                            "changed_bytes": acc_w.changed_bytes, "max_abs": acc_w.max_abs, "l2_rel": acc_w.l2_rel},
        }
        if not empty_ok:
            rec["reasons"].append(f"{direc.label}: EMPTY subset cross does not reproduce the recipient's natural "
                                  f"endpoint (first difference {_fd(ep_e, nr)}, changed bytes {acc_e.changed_bytes})")
        if not all_ok:
            rec["reasons"].append(f"{direc.label}: ALL subset cross differs from the whole-KV cross "
                                  f"(first difference {_fd(ep_a, ep_w)}, payload equals donor: {mixed_is_donor})")
    rec["passed"] = not rec["reasons"]
    rec["seconds"] = time.perf_counter() - t0
    return rec
