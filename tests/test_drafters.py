"""Drafters: one grammar (resolve), the session n-gram cache, the no-gain gate and its
calibration, and what the campaign hands each block (feed, breakdown by group and prompt)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from statelab.errors import ConfigError
from statelab.speculative import drafters
from statelab.speculative.drafters import Gate, NgramDrafter, VerifyCosts


def _h(*toks):
    return np.asarray(toks, dtype=np.int32)


# -- the grammar -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [("ngram", "ngram:2-4"), ("ngram:3", "ngram:3-3"), ("ngram:1-8", "ngram:1-8"),
                                       ("ngram:1-8+session", "ngram:1-8+session"), ("ngram+session", "ngram:2-4+session"),
                                       ("self", "self"), ("derive:4", "derive:4"), ("none", None), ("", None),
                                       (None, None)])
def test_check_accepts_every_kind(text, want):
    assert drafters.check(text) == want


@pytest.mark.parametrize("bad", ["bogus", "derive:", "derive:x", "derive:0", "ngrams", "ngram:", "ngram:4-2",
                                 "ngram:1-8+cache", "session"])
def test_check_rejects_in_one_line_built_from_the_kinds(bad):
    with pytest.raises(ConfigError) as e:
        drafters.check(bad)
    msg = str(e.value)
    assert "\n" not in msg
    if not bad.startswith("ngram"):  # the n-gram forms say what an n-gram range must be
        assert all(form in msg for form, _ in drafters.KINDS), msg


def test_resolve_builds_the_drafter():
    d = drafters.resolve("ngram:1-8+session")
    assert isinstance(d, NgramDrafter) and d.session and (d.nmin, d.nmax) == (1, 8) and d.text == "ngram:1-8+session"
    assert not drafters.resolve("ngram:2-4").session
    m = drafters.resolve("self")
    assert m.needs_model and m.path is None and m.text == "self"
    assert drafters.resolve("none") is None
    with pytest.raises(ConfigError, match="draft model not found"):
        drafters.resolve("missing-draft.gguf")


def test_cli_rejects_a_bad_drafter_in_one_line(capsys, monkeypatch):
    """In process: the CLI's own main (one line on stderr, exit 2), before any model loads."""
    from statelab.cli.main import main

    monkeypatch.setattr(sys, "argv", ["statelab", "spec", "run", "-H", "2", "--arms", "C_QB", "--draft", "ngram:1-8+x",
                                      "--cap", "4"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "n-gram" in lines[0], err


# -- the session cache ---------------------------------------------------------------------------

def test_session_cache_proposes_from_earlier_outputs():
    d = NgramDrafter(2, 4, session=True)
    h = _h(1, 2, 3, 9, 8)  # the suffix (9 8) never occurred in the request
    assert len(d.propose(h, 3)) == 0 and d.key is None
    d.remember(_h(7, 9, 8, 4, 5, 6))
    assert d.propose(h, 3).tolist() == [4, 5, 6] and d.key == ("session", 2)
    # a continuation stops at the end of the earlier output (never runs into the next one)
    d.remember(_h(0, 9, 8, 4))
    assert d.propose(h, 3).tolist() == [4]  # the most recent occurrence; cut at its output's end
    d2 = NgramDrafter(2, 4, session=True)
    d2.remember(_h(9, 8, 4))
    assert len(d2.propose(h, 3)) == 1
    d2.forget()
    assert len(d2.propose(h, 3)) == 0


def test_session_cache_prefers_the_longer_match_and_the_request_on_ties():
    d = NgramDrafter(1, 4, session=True)
    d.remember(_h(1, 2, 3, 50, 51))
    h = _h(2, 3, 60, 1, 2, 3)  # the request holds (2 3) -> 60; the session holds (1 2 3) -> 50
    assert d.propose(h, 2).tolist() == [50, 51] and d.key == ("session", 3)
    h = _h(7, 2, 3, 60, 1, 2, 3)  # now the request holds (2 3) and the session (1 2 3): longer wins
    assert d.propose(h, 1).tolist() == [50]
    d = NgramDrafter(1, 4, session=True)
    d.remember(_h(2, 3, 50))
    assert d.propose(_h(2, 3, 60, 2, 3), 1).tolist() == [60] and d.key == ("request", 2)


def test_without_session_remember_keeps_nothing():
    d = NgramDrafter(2, 4)
    d.remember(_h(9, 8, 4, 5))
    assert len(d.propose(_h(1, 9, 8), 3)) == 0


def test_session_matches_a_brute_force_search():
    rng = np.random.default_rng(11)
    for _ in range(200):
        outs = [rng.integers(0, 4, size=int(rng.integers(1, 12))).astype(np.int32) for _ in range(3)]
        h = rng.integers(0, 4, size=int(rng.integers(1, 10))).astype(np.int32)
        d = NgramDrafter(1, 3, session=True)
        for o in outs:
            d.remember(o)
        got = d.propose(h, 4).tolist()

        def best(seqs, lo, hi, h=h):
            """Longest n in [lo, hi] first, most recent occurrence with a continuation."""
            for n in range(min(hi, len(h)), lo - 1, -1):
                hits = [(si, j) for si, s in enumerate(seqs) for j in range(n - 1, len(s) - 1)
                        if list(s[j - n + 1:j + 1]) == list(h[len(h) - n:])]
                if hits:
                    si, j = hits[-1]
                    return n, list(seqs[si][j + 1:j + 5])
            return 0, []

        n_req, want_req = best([h], 1, 3)
        n_ses, want_ses = best(outs, 1, 3)
        if n_req == n_ses == 3:  # both reach NMAX: the one matching further back
            n_req, want_req = best([h], 3, drafters.EXTEND)
            n_ses, want_ses = best(outs, 3, drafters.EXTEND)
        want = want_ses if n_ses > n_req else want_req
        assert got == want, (h.tolist(), [o.tolist() for o in outs])


# -- the gate ---------------------------------------------------------------------------------

P3 = np.arange(3, dtype=np.int32)  # a proposal of three tokens (the gain gate reads only its length)
H = np.zeros(0, dtype=np.int32)  # a history the gain gate does not read

def test_gate_declines_when_rows_cost_more_than_they_can_save():
    dear = VerifyCosts(same=(1.0, 50.0, 50.0, 50.0), change=(1.0, 50.0, 50.0, 50.0))
    g = Gate(dear)
    assert g.choose(("request", 3), P3, H, 0, 1, None) == 0 and g.declined == 1
    assert g.choose(("request", 3), P3, H, 0, 4, 4) == 0  # fixed rows: the padded verify is no cheaper either


def test_gate_submits_when_rows_are_cheap_and_follows_acceptance():
    cheap = VerifyCosts(same=(1.0, 1.1, 1.2, 1.3), change=(1.5, 1.6, 1.7, 1.8))
    g = Gate(cheap)
    assert g.choose("k", P3, H, 0, 1, None) == 3  # rows follow p: the best length is all three
    assert g.acceptance("new") == 0.75  # optimistic: a kind of match never tried is tried
    for _ in range(30):  # a kind of match that is always rejected loses its proposals
        g.update("bad", 3, 0)
    assert g.choose("bad", P3, H, 0, 1, None) == 0
    for _ in range(30):
        g.update("good", 3, 3)
    assert g.acceptance("good") > 0.95 and g.choose("good", P3, H, 0, 1, None) == 3
    # a shape change dearer than the rows: staying at 4 rows beats a 1-row call even for a poor proposal ...
    sticky = Gate(VerifyCosts(same=(1.0, 1.1, 1.2, 1.3), change=(4.0, 4.0, 4.0, 4.0)), stats=dict(g.stats))
    assert sticky.choose("bad", P3, H, 0, 4, None) == 3
    # ... but not for ever: when 4 rows cost far more than one, the gate leaves them (the change paid once)
    leave = Gate(VerifyCosts(same=(1.0, 2.0, 2.5, 3.0), change=(4.0, 4.0, 4.0, 4.0)), stats=dict(g.stats))
    assert leave.choose("bad", P3, H, 0, 4, 4) == 0 and leave.plain(4, 4) == (1, 1.75)
    assert leave.choose("good", P3, H, 0, 4, 4) == 3
    # fixed rows, previous call 4 rows: no proposal keeps the padded 4-row call when that is cheaper
    assert sticky.plain(4, 4) == (4, 1.3) and sticky.plain(1, 4) == (1, 1.0) and g.plain(1, 4) == (1, 1.0)
    g.start()
    assert g.stats == {}


def _shadow_request(out: np.ndarray, good_from: int, gate, rows_fixed: int = 8):
    """A request whose drafter proposes the next 7 tokens of ``out`` from position ``good_from``
    on and 7 wrong ones before it, decided by verify_plan as the transaction decides; (cycles,
    regime per cycle, seconds) with the gate's calibrated costs as each call's time."""
    from statelab.speculative.transaction import verify_plan

    L, prev, regimes, seconds = 1, 0, [], 0.0
    while L < len(out):
        props = out[L:L + 7] + (0 if L >= good_from else 1)
        p, rows = verify_plan(gate, "k", props, out, L, prev, rows_fixed)
        want = out[L:L + p]
        agree = props[:len(want)] == want
        m = len(want) if agree.all() else int(np.argmin(agree))
        s = gate.costs.same[rows - 1] if rows == prev else gate.costs.change[rows - 1]
        regimes.append(gate.drafting)
        gate.update("k", p, m, rows, prev, s)
        seconds += s
        prev, L = rows, L + m + 1
    return regimes, seconds


def test_shadow_gate_leaves_drafting_that_loses_and_returns_when_the_shadow_says_it_pays():
    from statelab.speculative.drafters import ShadowGate

    costs = VerifyCosts(same=(1.0,) + (2.0,) * 7, change=(4.0,) * 8)
    out = np.arange(400, dtype=np.int32)
    g = ShadowGate(costs)
    g.start()
    regimes, seconds = _shadow_request(out, 120, g)
    changes = [i for i in range(1, len(regimes)) if regimes[i] != regimes[i - 1]]
    assert regimes[0] and len(changes) == 2, changes  # drafting, plain over the bad part, drafting again
    assert changes[0] == g.dwell  # it left after its dwell of wrong proposals
    assert not regimes[changes[0]] and g.drafting and g.declined > 0
    # better than either regime alone on this request
    for fixed in (True, False):
        other = ShadowGate(costs, dwell=10 ** 9, prior=2.0 if fixed else 0.0)
        other.start()
        other.drafting = fixed
        assert seconds < _shadow_request(out, 120, other)[1]
    # every proposal right from the start: it never leaves drafting and declines nothing
    g.start()
    g.declined = 0
    regimes, _ = _shadow_request(out, 0, g)
    assert all(regimes) and g.declined == 0
    # plain cycles are one row; drafting keeps the fixed shape when nothing is proposed
    assert g.plain(8, 8) == (8, 2.0)
    g.drafting = False
    assert g.plain(8, 8) == (1, 1.0)


def test_shadow_gate_asks_no_proposal_while_its_shadow_one_is_open():
    """Plain with a shadow proposal still open, the drafter is not asked (its proposal would go
    unused): the same decisions, cycle for cycle, with fewer proposals; a model drafter (it
    consumes the pending token by proposing) and the gain gate are asked every cycle."""
    from statelab.speculative.drafters import Drafter, ShadowGate
    from statelab.speculative.transaction import cycle_proposal, verify_plan

    class Counting(Drafter):  # the next 7 tokens of out, wrong before position 120
        calls = 0

        def propose(self, history, k):
            self.calls += 1
            L = len(history)
            return out[L:L + k] + (0 if L >= 120 else 1)

    costs = VerifyCosts(same=(1.0,) + (2.0,) * 7, change=(4.0,) * 8)
    out = np.arange(400, dtype=np.int32)

    def run(ask_gate: bool):
        g, d = ShadowGate(costs), Counting()
        g.start()
        L, prev, trace = 1, 0, []
        while L < len(out):
            props, key = cycle_proposal(d, g, out, L, 7) if ask_gate else (d.propose(out[:L], 7), d.key)
            p, rows = verify_plan(g, key, props, out, L, prev, 8)
            want = out[L:L + p]
            m = p if (props[:p] == want).all() else int(np.argmin(props[:p] == want))
            trace.append((L, p, rows, g.drafting))
            g.update(key, p, m, rows, prev, costs.same[rows - 1])
            prev, L = rows, L + m + 1
        return trace, d.calls, len(trace)

    (t_ask, n_ask, cycles), (t_all, n_all, _) = run(True), run(False)
    assert t_ask == t_all and n_all == cycles and n_ask < cycles
    # a wrong shadow proposal settles on the next decode, so only a right one (from 120 on)
    # stays open over cycles: those plain cycles asked nothing
    right_plain = sum(1 for L, p, rows, drafting in t_ask if L >= 120 and not drafting)
    assert 0 < cycles - n_ask < right_plain
    model = Counting()
    model.needs_model = True
    g = ShadowGate(costs)
    g.start()
    g.drafting, g.shadow = False, (1, out[1:8])  # plain, a shadow proposal open (1 of 7 settled)
    assert not g.wants_proposal(out, 2)
    assert len(cycle_proposal(model, g, out, 2, 7)[0]) == 7 and model.calls == 1
    assert Gate(costs).wants_proposal(out, 2)


def test_a_shadow_proposal_is_open_while_plain_until_it_disagrees_or_is_used_up():
    """ShadowGate.wants_proposal (what the plain-regime loop asks each cycle): while plain, False as
    long as the committed tokens agree with the shadow proposal and some of it is still to come;
    True while drafting, with no shadow, once it disagreed or is used up (then it is settled); the
    gain gate is never plain."""
    from statelab.speculative.drafters import ShadowGate

    costs = VerifyCosts(same=(1.0,) * 4, change=(1.0,) * 4)
    out = np.arange(40, dtype=np.int32)
    g = ShadowGate(costs)
    g.start()
    assert g.wants_proposal(out, 5)  # drafting
    g.drafting = False
    assert g.wants_proposal(out, 5)  # plain, no shadow proposal
    g.shadow = (5, out[5:9].copy())
    assert not g.wants_proposal(out, 5) and not g.wants_proposal(out, 8)
    assert g.wants_proposal(out, 9) and g.shadow is None  # used up: settled
    g.shadow = (5, np.array([5, 6, 99, 8], dtype=np.int32))
    assert not g.wants_proposal(out, 7) and g.wants_proposal(out, 8) and g.shadow is None  # 7 != 99
    assert g.is_plain() and not Gate(costs).is_plain()


def test_shadow_gate_follows_the_measured_cycle_time():
    """The regime's cost follows the measured wall time of same-shape cycles (host work included)."""
    from statelab.speculative.drafters import ShadowGate

    costs = VerifyCosts(same=(1.0,) + (1.2,) * 7, change=(4.0,) * 8)
    g = ShadowGate(costs)
    g.start()
    g.choose("k", P3, H, 0, 0, 8)
    assert g._cycle_seconds(True) == 1.2
    for _ in range(40):
        g.update("k", 3, 0, 8, 8, 5.0)  # what the device took: drafting at 8 rows is dear
    assert abs(g._cycle_seconds(True) - 5.0) < 0.1 and not g.drafting
    g.update("k", 3, 0, 8, 1, 99.0)  # a changed shape is not the regime's own cost ...
    g.update("k", 3, 0, 8, 8, 99.0)  # ... nor the next call (ggml-cuda captures its CUDA graph there)
    assert abs(g._cycle_seconds(True) - 5.0) < 0.1
    g.update("k", 3, 0, 8, 8, 99.0)  # a stall counts at most twice the running figure
    assert g._cycle_seconds(True) < 5.0 * 1.1


def test_gate_kinds_are_one_vocabulary():
    from statelab.speculative.drafters import GATES, ShadowGate, check_gate, make_gate

    c = VerifyCosts((1.0, 2.0), (3.0, 4.0))
    assert isinstance(make_gate(True, c), Gate) and isinstance(make_gate("shadow", c), ShadowGate)
    assert make_gate(False, c) is None and set(GATES) == {"gain", "shadow"}
    with pytest.raises(ConfigError, match="unknown gate 'fast'"):
        check_gate("fast")


def test_verify_costs_round_trip_and_checks():
    c = VerifyCosts((0.001, 0.002), (0.003, 0.004))
    assert VerifyCosts.from_dict(c.as_dict()) == c and c.rows == 2 and c.cost(2, 2) == 0.002
    # a shape change's extra is spread over the calls the new shape is expected to last
    assert c.cost(2, 1) == pytest.approx(0.002 + (0.004 - 0.002) / drafters.SPAN) and c.cost(2, 0) == 0.002
    with pytest.raises(ConfigError):
        VerifyCosts((0.001,), (0.001, 0.002))


# -- what the campaign hands each block ----------------------------------------------------------

def test_feed_gives_each_block_its_sessions_earlier_outputs_and_costs():
    from statelab.experiments.campaign import feed

    jobs = [{"block": 0, "session": 0, "arm": "C_QB", "draft": "d", "calibrate": True, "prompt_index": -1}]
    for s in (0, 1):
        for pi in range(3):
            for arm in ("R", "C_QB"):
                jobs.append({"block": len(jobs), "session": s, "arm": arm, "draft": "d" if arm != "R" else None,
                             "prompt_index": pi})
    done = {"block-0": {"costs": {"same": [1.0], "change": [1.0]}, "records": []}}
    for j in jobs[1:]:
        if j["session"] == 0 and j["prompt_index"] < 2:
            done[f"block-{j['block']}"] = {"records": [{"tokens": [j["prompt_index"], 100 + j["block"]]}]}
    feed(jobs, done, session=True)
    c = {(j["session"], j["arm"], j["prompt_index"]): j for j in jobs if not j.get("calibrate")}
    assert c[(0, "C_QB", 0)]["session_outputs"] == []
    assert c[(0, "C_QB", 2)]["session_outputs"] == [[0, 102], [1, 104]]  # its own arm's outputs, in session order
    assert c[(0, "C_QB", 1)]["session_outputs"] == [[0, 102]]
    assert c[(1, "C_QB", 2)]["session_outputs"] == [] and c[(1, "C_QB", 2)]["costs"] is None  # a new session
    assert c[(0, "C_QB", 2)]["costs"] == {"same": [1.0], "change": [1.0]}
    assert "session_outputs" not in c[(0, "R", 2)]


def test_plan_hands_the_gate_kind_to_each_drafting_block():
    from statelab.experiments.campaign import CampaignSpec, gate_words, plan

    spec = CampaignSpec(prompts=["HumanEval/3", "HumanEval/5"], arms=["R", "C_QB"], draft="ngram:1-8", gate="shadow",
                        sessions=2)
    spec.validate()
    jobs = plan(spec, "ngram:1-8")
    assert sum(bool(j.get("calibrate")) for j in jobs) == 2  # one calibration per session
    runs = [j for j in jobs if not j.get("calibrate")]
    assert {j.get("gate") for j in runs if j["arm"] == "C_QB"} == {"shadow"}
    assert all("gate" not in j for j in runs if j["arm"] == "R")
    assert gate_words("shadow").endswith("(shadow)") and gate_words(True).endswith("(gain)") and gate_words(False) == ""


def test_breakdown_by_group_and_prompt():
    from statelab.experiments.campaign import (
        CampaignSpec,
        breakdown,
        breakdown_markdown,
        contrasts,
    )
    from statelab.experiments.spec_run import prompt_key

    spec = CampaignSpec(prompts=["HumanEval/57", "text:hello there"], arms=["R", "C_QB"], draft="ngram:1-8",
                        resamples=200)
    keys = [k for _, k in spec.prompt_table()]
    recs = []
    for s in range(3):
        for key, speed in zip(keys, (2.0, 0.5)):
            pid, sha = key.rsplit("@", 1)
            for arm, sec in (("R", 1.0 + 0.01 * s), ("C_QB", (1.0 + 0.01 * s) / speed)):
                recs.append({"arm": arm, "prompt": pid, "prompt_sha256": sha, "key": key, "session": s,
                             "seconds": sec, "qualified": True})
    assert prompt_key(recs[0]) == keys[0]
    rows = contrasts(recs, spec.ratios[-1:], 1.02, 1, 200)
    parts = breakdown(spec, recs, rows)
    by = {(p["scope"], p["name"]): p for p in parts}
    assert by[("prompt", keys[0])]["estimate"] == pytest.approx(2.0)
    assert by[("prompt", keys[1])]["estimate"] == pytest.approx(0.5)
    assert by[("group", "code")]["estimate"] == pytest.approx(2.0) and by[("group", "other")]["prompts"] == 1
    md = "\n".join(breakdown_markdown(parts))
    assert "1 of 2 prompts below 1.0" in md


# -- on the real model ---------------------------------------------------------------------------

def _layouts_or_skip():
    from statelab.runtime import layouts

    if not layouts.available():
        pytest.skip("attention-layout patch not in this build")


@pytest.mark.model
def test_session_cache_accepts_more_on_a_repeated_request(model, he):
    """A second identical request finds the first one's output in the session cache: it
    accepts more per verify; both reproduce R exactly."""
    from statelab.speculative.transaction import Runner, SpecConfig, qualify

    _layouts_or_skip()
    cfg = SpecConfig(k=3, k_max=7, fixed_rows=True, cap=24, threads=1)
    runner = Runner(model, None, cfg, draft="ngram:2-6+session")
    p = he("HumanEval/57")
    ref = runner.run("R", p)
    first = runner.run("C_QB", p, learn=True)
    second = runner.run("C_QB", p, learn=True)
    res = qualify([ref, first, second])
    assert res[1].qualified and res[2].qualified
    a, b = first.counters, second.counters
    assert b.accepted > a.accepted and b.verify_calls < a.verify_calls, (a, b)
    assert len(runner.drafter.corpus) == 2 * (first.endpoint.length + 1)


@pytest.mark.model
def test_gate_turns_drafting_off_when_verify_is_dear_and_output_stays_r(model, he):
    from statelab.speculative.transaction import Runner, SpecConfig, qualify

    _layouts_or_skip()
    cfg = SpecConfig(k=3, fixed_rows=True, cap=16, threads=1)
    p = he("HumanEval/155")
    dear = VerifyCosts(same=(0.001, 1.0, 1.0, 1.0), change=(0.001, 1.0, 1.0, 1.0))
    cheap = VerifyCosts(same=(0.001,) * 4, change=(0.001,) * 4)
    off = Runner(model, None, cfg, draft="ngram:1-8", costs={"C_QB": dear})
    on = Runner(model, None, cfg, draft="ngram:1-8", costs={"C_QB": cheap})
    shadow = Runner(model, None, cfg, draft="ngram:1-8", costs={"C_QB": cheap}, gate="shadow")
    res = qualify([off.run("R", p), off.run("C_QB", p), on.run("C_QB", p), shadow.run("C_QB", p)])
    assert res[1].qualified and res[2].qualified and res[3].qualified
    c_off, c_on = res[1].counters, res[2].counters
    assert c_off.proposals == 0 and c_off.declined > 0 and c_off.verify_rows == c_off.verify_calls  # plain 1-row
    assert c_on.proposals > 0 and c_on.declined == 0
    # the shadow gate starts drafting: its first cycles submit what the drafter proposes
    assert res[3].counters.proposals > 0 and res[3].endpoint.tokens.tolist() == res[0].endpoint.tokens.tolist()
    with pytest.raises(ConfigError, match="unknown gate"):
        Runner(model, None, cfg, draft="ngram:1-8", gate="fastest")


@pytest.mark.model
def test_spec_run_gate_kind_alone_gates_and_an_unknown_kind_is_one_line(tmp_path):
    """`spec run --gate-kind shadow` gates (it implies --gate) and says which gate in its title;
    an unknown kind is refused in one line, exit 2, before a model is loaded."""
    from conftest import run_cli

    _layouts_or_skip()
    out = tmp_path / "spec.json"
    r = run_cli("spec", "run", "-H", "HumanEval/155", "--cap", "8", "--arms", "R,C_QB", "--draft", "ngram:1-8",
                "--fixed-rows", "--gate-kind", "shadow", "--threads", "1", "--no-warmup", "--json", out)
    assert r.returncode == 0, r.stderr
    assert "gate shadow" in " ".join(r.stdout.split())
    c = {x["arm"]: x for x in json.loads(out.read_text())}["C_QB"]
    assert c["qualified"] is True and c["proposals"] > 0
    r = run_cli("spec", "run", "-H", "HumanEval/155", "--arms", "R,C_QB", "--draft", "ngram:1-8", "--gate-kind", "fast")
    assert r.returncode == 2 and "unknown gate 'fast'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.model
def test_calibration_measures_every_row_count(model, he):
    from statelab.speculative.transaction import Runner, SpecConfig

    _layouts_or_skip()
    runner = Runner(model, None, SpecConfig(k=2, k_max=3, fixed_rows=True, cap=8, threads=1), draft="ngram:1-8")
    c = runner.measure_verify_costs("C_QB", he("HumanEval/155"), calls=2)
    assert c.rows == 4 and all(x > 0 for x in c.same + c.change)
    # the gate built from a real calibration runs and still reproduces R
    runner.costs = {"C_QB": c}
    from statelab.speculative.transaction import qualify

    res = qualify([runner.run("R", he("HumanEval/155")), runner.run("C_QB", he("HumanEval/155"))])
    assert res[1].qualified


def test_adaptive_k_reaches_seven_with_fixed_rows():
    from statelab.speculative.transaction import AdaptiveK, SpecConfig

    k = AdaptiveK(3, 7)
    for p in (3, 4, 5, 6, 7, 7):
        assert k.k == p
        k.update(p, p)
    assert k.k == 7
    k.update(7, 2)
    assert k.k == 3
    cfg = SpecConfig(k=3, k_max=7, fixed_rows=True)
    assert cfg.rows == 8 and cfg.target_ubatch == 8 and cfg.queries == 8


@pytest.mark.model
def test_the_plain_regime_prices_its_cycles_with_the_shadow_lookup_included(model, he):
    """A plain run tells the shadow gate each cycle's whole time, the drafter's shadow lookup
    included (as a drafting cycle's time includes its proposal), not the decode call alone:
    with a lookup made 3 ms slower, the seconds the gate is given exceed the decode calls'
    by 3 ms per lookup."""
    import time

    from statelab.speculative.drafters import ShadowGate
    from statelab.speculative.transaction import Arm, Runner, SpecConfig, Transaction

    class Recording(ShadowGate):
        seen: list

        def update(self, key, proposed, accepted, rows=0, prev_rows=0, seconds=0.0):
            self.seen.append(seconds)
            super().update(key, proposed, accepted, rows, prev_rows, seconds)

    _layouts_or_skip()
    cfg = SpecConfig(k=3, fixed_rows=True, cap=24, threads=1)
    runner = Runner(model, None, cfg, draft="ngram:1-8")
    lookups, slow = [], 0.003
    real = runner.drafter.propose

    def propose(hist, k):
        lookups.append(k)
        time.sleep(slow)
        return real(hist, k)

    runner.drafter.propose = propose
    arm = Arm.parse("C_QB")
    t, d = runner.contexts(arm)
    try:
        gate = Recording(VerifyCosts(same=(0.001,) * 4, change=(0.001,) * 4), dwell=10 ** 9, start_drafting=False)
        gate.seen = []
        tx = Transaction(arm, t, d, cfg.k, cfg.mask, drafter=runner.drafter, k_max=cfg.k_max, fixed_rows=True, gate=gate)
        tx.run(model.tokenize(he("HumanEval/57").text), cfg.cap)
    finally:
        t.close()
    assert tx.c.proposals == 0 and len(gate.seen) == tx.c.cycles > 0 and lookups  # held plain, shadow lookups made
    assert sum(gate.seen) >= tx.c.t_verify + slow * len(lookups)


@pytest.mark.model
@pytest.mark.parametrize("dwell", [10 ** 9, 4])
def test_the_plain_regime_runs_as_r_steps_with_the_same_counts(model, he, monkeypatch, dwell):
    """A shadow gate's plain regime runs as one loop of R's step (Transaction._plain_run), its
    shadow proposals settled and asked for in the loop; the output is R's bit for bit and every
    count (cycles, calls, rows, proposals, accepted, declined) is the general loop's, cycle for
    cycle.  ``start_drafting`` False starts the shadow gate plain; an endless ``dwell`` holds it
    there, ``dwell`` 4 lets it turn both ways (its cycle times left out, so the turns depend on
    the tokens alone and both loops see the same ones).  The plain run sets the target's layout
    once, where the general loop sets it around every one-row call."""
    from statelab.speculative.drafters import ShadowGate
    from statelab.speculative.transaction import Arm, Runner, SpecConfig, Transaction

    class TokensOnly(ShadowGate):
        def update(self, key, proposed, accepted, rows=0, prev_rows=0, seconds=0.0):
            super().update(key, proposed, accepted, rows, prev_rows, 0.0)

    _layouts_or_skip()
    cfg = SpecConfig(k=3, fixed_rows=True, cap=64, threads=1)
    runner = Runner(model, None, cfg, draft="ngram:1-8")
    p = he("HumanEval/57")
    ref = runner.run("R", p).endpoint.tokens.tolist()
    costs = VerifyCosts(same=(0.001,) * 4, change=(0.001,) * 4)
    runs, committed = {}, []
    real = Transaction._plain_run

    def counted(self, *a):
        n = real(self, *a)
        committed.append(n)
        return n

    from statelab.runtime import layouts
    sets, real_set = [], layouts.set_layout

    def set_counted(ctx, name):
        sets.append(name)
        real_set(ctx, name)

    monkeypatch.setattr(Transaction, "_plain_run", counted)
    monkeypatch.setattr(layouts, "set_layout", set_counted)
    n_sets = {}
    for fast in (True, False):
        sets.clear()
        arm = Arm.parse("C_QB")
        t, d = runner.contexts(arm)
        try:
            gate = TokensOnly(costs, dwell=dwell, start_drafting=False)
            tx = Transaction(arm, t, d, cfg.k, cfg.mask, drafter=runner.drafter, k_max=cfg.k_max,
                             fixed_rows=True, gate=gate)
            tx.plain_runs = fast
            ep = tx.run(model.tokenize(p.text), cfg.cap)
        finally:
            t.close()
        runs[fast] = (ep.tokens.tolist(), tx.c.counts(), tx.gate.declined)
        n_sets[fast] = len(sets)
        if fast:
            fast_calls = list(committed)
    assert runs[True][0] == runs[False][0] == ref
    assert runs[True][1] == runs[False][1] and runs[True][2] == runs[False][2] > 0
    c = runs[True][1]
    assert sum(fast_calls) > 0 and len(committed) == len(fast_calls)  # none when switched off
    # the layout is set (and restored) once per plain run, against once around every one-row call
    assert n_sets[False] - n_sets[True] == 2 * (sum(fast_calls) - len(fast_calls)) > 0
    if dwell > 64:  # held plain: one row each, no proposal submitted
        assert c["proposals"] == 0 and c["verify_rows"] == c["verify_calls"] == c["cycles"]
    else:  # it turned to drafting and back: proposals submitted, and plain runs after them
        assert c["proposals"] > 0 and c["verify_rows"] > c["verify_calls"]
        assert sum(fast_calls) < c["committed"]
