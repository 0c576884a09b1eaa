"""The speculative path on the real model (CPU): transaction, arms, qualification, bad input."""
import json

import numpy as np
import pytest

from statelab.experiments.campaign import CampaignSpec, report_markdown, run_campaign
from statelab.experiments.masks import mask_lattice
from statelab.experiments.spec_run import prompt_key, qualify_records
from statelab.errors import ConfigError, IdentityError
from statelab.speculative.drafters import parse_ngram
from statelab.speculative.transaction import AdaptiveK, Arm, NgramDrafter, PhaseGuard, Runner, SpecConfig, qualify

CAP = 24


def test_phase_guard_bits_and_reset():
    g = PhaseGuard("QB", 3)
    assert g.active("target") == "QB" and g.active("draft") == "MQ"
    g.phase["target"] = "continuation"
    assert g.active("target") == "QB"
    g2 = PhaseGuard("QB", 1)
    g2.phase["target"] = "continuation"
    assert g2.active("target") == "MQ"
    g2.new_request()
    assert g2.phase == {"target": "prefill", "draft": "prefill"} and g2.active("target") == "QB"
    assert PhaseGuard("PQ", 8).active("draft") == "MQ"


def test_mask_lattice_minimal_sets():
    passing = {m: bool(m & 3 == 3) for m in range(16)}
    _g, minimal = mask_lattice(passing)
    assert minimal == [3]
    passing = {m: m in (5, 7, 13, 15, 6, 14) for m in range(16)}
    assert mask_lattice(passing)[1] == [5, 6]


@pytest.mark.parametrize("bad, match", [
    (dict(k=0), r"k must be an integer in 1\.\."), (dict(mask=16), "phase mask"), (dict(mask=-1), "phase mask"),
    (dict(ubatch=-1), "ubatch"), (dict(cap=0), "output cap"), (dict(k=4, k_max=3), "k_max"),
    (dict(max_queries=-2), "max queries")])
def test_bad_spec_config(bad, match):
    with pytest.raises(ConfigError, match=match):
        SpecConfig(**bad)


def test_unknown_arm_and_layout():
    with pytest.raises(ConfigError, match="unknown arm"):
        Arm.parse("M_XY")
    with pytest.raises(ConfigError, match="unknown layout"):
        PhaseGuard("ZZ", 3)


def test_qualification_records():
    recs = [dict(arm="R", prompt="p", prompt_sha256="ab" * 32, tokens=[1, 2, 3], eog=True),
            dict(arm="M0", prompt="p", prompt_sha256="ab" * 32, tokens=[1, 2, 4], eog=True),
            dict(arm="C_QB", prompt="p", prompt_sha256="ab" * 32, tokens=[1, 2, 3], eog=True)]
    q = {r["arm"]: (r["qualified"], r["first_diff"]) for r in qualify_records(recs)}
    assert q == {"R": (True, None), "M0": (False, 2), "C_QB": (True, None)}


@pytest.mark.model
def test_draft_with_another_vocabulary_is_refused(model, tmp_path, cli):
    from gguf import GGUFWriter

    path = tmp_path / "other.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = cli("spec", "run", "-H", "2", "--arms", "C0", "--draft", path, "--cap", "4")
    assert r.returncode != 0 and "vocabulary" in r.stderr and "Traceback" not in r.stderr
    from statelab.speculative.transaction import check_draft_paths

    with pytest.raises(IdentityError, match="vocabulary"):
        check_draft_paths(model.path, path)


@pytest.mark.model
def test_transaction_consumes_pending_once_and_matches_reference(model, he):
    """Self-draft C0: every proposal is accepted, the endpoint equals the target-only arm
    with the same ubatch, and the target KV ends exactly at the committed length."""
    runner = Runner(model, model, SpecConfig(k=3, ubatch=4, cap=CAP))
    p = he(2)
    res = qualify([runner.run(a, p) for a in ("R", "M0", "C0", "M_GS", "C_GS")])
    by = {r.arm: r for r in res}
    assert by["C0"].endpoint.same(by["M0"].endpoint)
    assert by["C0"].counters.accepted == by["C0"].counters.proposals > 0
    assert by["C0"].counters.rollbacks == 0
    # GS: one row per call, so callers == micrographs, every row physically alone
    assert by["M_GS"].counters.target_callers == by["M_GS"].counters.target_micrographs
    assert by["C_GS"].endpoint.same(by["M_GS"].endpoint)
    for r in res:  # honest reporting: every arm has a verdict against R
        assert r.qualified is not None


@pytest.mark.model
def test_rollback_path_with_a_truncated_draft(model, he, tmp_path):
    """A 2-layer draft disagrees often: rollbacks happen, and the endpoint still equals the
    target-only arm of the same geometry (speculation changes no committed token there)."""
    from statelab.speculative.derive import derive_truncated
    from statelab.runtime import Model

    path = tmp_path / "d2.gguf"
    derive_truncated(None, path, 2)
    draft = Model(path)
    runner = Runner(model, draft, SpecConfig(k=3, ubatch=4, cap=CAP))
    p = he(2)
    c0, m0 = runner.run("C0", p), runner.run("M0", p)
    assert c0.counters.rollbacks > 0 and c0.counters.accepted < c0.counters.proposals
    assert c0.endpoint.length == m0.endpoint.length
    # verification of k+1 rows at ubatch 4 may differ numerically from single-row M0 decode:
    # record, don't assume; but the committed tokens are the target's greedy choices
    assert c0.endpoint.tokens[0] == m0.endpoint.tokens[0]


@pytest.mark.model
def test_qb_panel_reports_every_arm_against_r(model, he, capsys):
    """A HumanEval panel: every arm gets a verdict against R; PQ and QB, which are bitwise
    equal in attention, must give identical endpoints and counters."""
    from statelab.runtime import layouts

    if not layouts.available():
        pytest.skip("attention-layout patch not in this build")
    runner = Runner(model, model, SpecConfig(k=3, ubatch=4, mask=3, cap=CAP))
    rows = []
    for task in ("HumanEval/2", "HumanEval/4"):
        res = qualify([runner.run(a, he(task)) for a in ("R", "M0", "M_QB", "M_PQ", "C_QB", "C_PQ")])
        by = {r.arm: r for r in res}
        for x, y in (("M_QB", "M_PQ"), ("C_QB", "C_PQ")):
            assert by[x].endpoint.same(by[y].endpoint), f"{task}: {x} and {y} differ"
            assert by[x].counters.counts() == by[y].counters.counts()
        assert by["C_QB"].counters.layout_not_admitted == 0
        rows += [(task, r.arm, r.qualified, r.first_diff) for r in res]
    with capsys.disabled():
        print("\nqualification against R (CPU, cap %d):" % CAP)
        for row in rows:
            print("  %s %-5s qualified=%s first_diff=%s" % row)
    assert all(q is not None for _, _, q, _ in rows)


# -- model-free drafting ----------------------------------------------------------------

def _h(*toks):
    return np.asarray(toks, dtype=np.int32)


def test_ngram_longest_match_first_then_most_recent():
    d = NgramDrafter(2, 4)
    # suffix (1 2 3): a length-3 match ends at 8 (followed by 7 8), a length-2 match later would lose
    h = _h(5, 1, 2, 3, 7, 8, 9, 2, 3, 6, 1, 2, 3)
    assert d.match(h) == (3, 3)
    assert d.propose(h, 2).tolist() == [7, 8]
    # two length-3 occurrences: the most recent one wins
    h = _h(1, 2, 3, 4, 0, 1, 2, 3, 5, 1, 2, 3)
    assert d.match(h) == (3, 7) and d.propose(h, 3).tolist() == [5, 1, 2]
    # the proposal may run into the suffix itself (a repeating pattern) and stops at the history's end
    h = _h(1, 2, 1, 2)
    assert d.propose(h, 5).tolist() == [1, 2]
    # only the last token recurs: no proposal unless NMIN is 1
    h = _h(4, 7, 9, 4)
    assert len(d.propose(h, 3)) == 0
    assert NgramDrafter(1, 3).propose(h, 3).tolist() == [7, 9, 4]
    # NMAX bounds the match: with n <= 2 the most recent length-2 occurrence is used
    h = _h(5, 1, 2, 3, 7, 8, 9, 2, 3, 6, 1, 2, 3)
    assert NgramDrafter(2, 2).propose(h, 1).tolist() == [6]
    assert len(d.propose(_h(3), 3)) == 0 and len(d.propose(h, 0)) == 0


def test_ngram_matches_a_brute_force_search():
    rng = np.random.default_rng(7)
    for _ in range(300):
        h = rng.integers(0, 4, size=int(rng.integers(1, 40))).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        want = []
        for n in range(hi, lo - 1, -1):  # longest n first, most recent earlier occurrence
            if n > len(h) - 1:
                continue
            ends = [j for j in range(n - 1, len(h) - 1) if list(h[j - n + 1:j + 1]) == list(h[len(h) - n:])]
            if ends:
                want = list(h[ends[-1] + 1:ends[-1] + 1 + 5])
                break
        assert NgramDrafter(lo, hi).propose(h, 5).tolist() == want, (h.tolist(), lo, hi)


@pytest.mark.parametrize("bad", ["ngram:", "ngram:0", "ngram:4-2", "ngram:a-b", "ngram:2-100", "ngrams"])
def test_bad_ngram_spec(bad):
    with pytest.raises(ConfigError, match="n-gram"):
        parse_ngram(bad)


def test_ngram_spec_forms():
    assert parse_ngram("ngram") == (2, 4) and parse_ngram("ngram:3") == (3, 3) and parse_ngram("ngram:1-6") == (1, 6)


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_on_rejection():
    k = AdaptiveK(3, 6)
    k.update(3, 3)
    k.update(4, 4)
    assert k.k == 5
    k.update(5, 1)
    assert k.k == 2
    k.update(0, 0)  # no proposal: no evidence
    assert k.k == 2
    k.update(2, 2)
    assert k.k == 3
    k.update(1, 1)  # a short proposal (the drafter had no more) accepted: k stays
    assert k.k == 3
    fixed = AdaptiveK(3)
    fixed.update(3, 0)
    assert fixed.k == 3 and not fixed.adaptive
    with pytest.raises(ConfigError):
        AdaptiveK(4, 2)


def test_rows_and_ubatch_follow_k():
    assert SpecConfig(k=3).target_ubatch == 4 and SpecConfig(k=3, k_max=7).target_ubatch == 8
    assert SpecConfig(k=3, k_max=7).queries == 8 and SpecConfig(k=3, ubatch=2).queries == 2


# -- prompt identity in campaign reports -------------------------------------------------------

def _records(keys_and_tokens):
    out = []
    for arm, pid, sha, toks in keys_and_tokens:
        out.append(dict(arm=arm, prompt=pid, prompt_sha256=sha, tokens=toks, eog=False, seconds=1.0, session=0,
                        request=0, accepted=0, proposals=0, committed=len(toks) - 1, verify_calls=len(toks) - 1))
    return out


def test_file_prompts_keep_their_rows_and_same_base_names_stay_apart(tmp_path):
    from statelab import prompts

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, pb = tmp_path / "a" / "p.txt", tmp_path / "b" / "p.txt"
    pa.write_text("def f():\n    return 1\n")
    pb.write_text("def g():\n    return 2\n")
    A, B = prompts.resolve(f"file:{pa}"), prompts.resolve(f"file:{pb}")
    assert A.id == B.id and prompt_key(A) != prompt_key(B)
    spec = CampaignSpec(prompts=[f"file:{pa}", f"file:{pb}"], arms=["R", "M_QB"])
    spec.validate()
    recs = qualify_records(_records([("R", A.id, A.sha256, [1, 2]), ("R", B.id, B.sha256, [3, 4]),
                                     ("M_QB", A.id, A.sha256, [1, 2]), ("M_QB", B.id, B.sha256, [3, 5])]))
    # each M_QB record is judged against the R of its own file, not the other one's
    assert [r["qualified"] for r in recs if r["arm"] == "M_QB"] == [True, False]
    md = report_markdown(spec, recs, [])
    rows = [ln for ln in md.splitlines() if ln.startswith("| M_QB |")]
    assert len(rows) == 2, md
    assert A.sha256[:12] in rows[0] and "yes" in rows[0] and B.sha256[:12] in rows[1] and "NO" in rows[1]
    # the same prompt listed twice is refused
    with pytest.raises(ConfigError, match="same prompt"):
        CampaignSpec(prompts=[f"file:{pa}", f"file:{tmp_path}/a/../a/p.txt"], arms=["R"]).validate()


@pytest.mark.model  # loading a campaign spec tokenizes its prompts with the model (n_ctx fit)
def test_campaign_spec_accepts_ngram_and_refuses_a_bad_one(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('prompts = ["HumanEval/3"]\narms = ["R", "C_QB"]\ndraft = "ngram:2-5"\nk = 3\nk_max = 7\n')
    spec = CampaignSpec.load(p)
    assert spec.spec_config().target_ubatch == 8
    assert CampaignSpec.load(p, draft="ngram:3", k_max=None).draft == "ngram:3"
    with pytest.raises(ConfigError, match="n-gram"):
        CampaignSpec.load(p, draft="ngram:9-2")


@pytest.mark.model
def test_argmax_rows_equals_the_native_greedy_sampler(model, he):
    from statelab.runtime import Context, ContextConfig

    ctx = Context(model, ContextConfig(n_ctx=512, n_batch=512, n_ubatch=8))
    try:
        toks = model.tokenize(he(3).text)
        ctx.decode(toks[:24], 0, logits="all")
        got = ctx.argmax_rows(24)
        native = [ctx.greedy(ctx.logits(i)) for i in range(24)]  # llama.cpp's greedy sampler on each row
        assert got.tolist() == native == [ctx.greedy_row(i) for i in range(24)]
    finally:
        ctx.close()


NGRAM_ARMS = ("R", "M_QB", "C_QB", "C_PQ", "C_GS")


@pytest.mark.model
@pytest.mark.parametrize("k, k_max, fixed", [(3, None, False), (2, 7, False), (7, None, True)])
def test_ngram_arms_reproduce_r(model, he, k, k_max, fixed, capsys):
    """The model-free drafter on the QB path: every drafting arm reproduces R's complete
    endpoint; proposals are accepted (several tokens per verify call) and rejected (rollbacks)."""
    from statelab.runtime import layouts

    if not layouts.available():
        pytest.skip("attention-layout patch not in this build")
    cfg = SpecConfig(k=k, k_max=k_max, fixed_rows=fixed, cap=40)
    runner = Runner(model, None, cfg, draft="ngram:2-4")
    res = qualify([runner.run(a, he("HumanEval/12")) for a in NGRAM_ARMS])
    by = {r.arm: r for r in res}
    for a in NGRAM_ARMS[1:]:
        assert by[a].qualified, f"{a} differs from R at {by[a].first_diff}"
    c = by["C_QB"].counters
    assert c.accepted > 0 and c.rollbacks > 0 and c.committed > c.verify_calls
    assert c.layout_not_admitted == 0 and c.committed == by["C_QB"].endpoint.length - 1
    if fixed:  # one verify shape: after the first build, llama.cpp reuses the graph
        assert c.verify_rows == c.verify_calls * (k + 1)
        assert c.graph_builds <= 2 and c.graph_reuses >= c.verify_calls - 2
    with capsys.disabled():
        print(f"\nngram k={k} k_max={k_max} fixed={fixed}: {c.committed / c.verify_calls:.2f} tokens/call, "
              f"accepted {c.accepted}/{c.proposals}, rollbacks {c.rollbacks}")


@pytest.mark.model
def test_bad_ngram_draft_is_one_line(cli):
    from conftest import one_line_error

    one_line_error(cli("spec", "run", "-H", "2", "--arms", "C_QB", "--draft", "ngram:5-2", "--cap", "4"), "n-gram")
    one_line_error(cli("spec", "run", "-H", "2", "--arms", "C_QB", "--draft", "ngram", "--k", "4", "--k-max", "2",
                       "--cap", "4"), "k_max")


@pytest.mark.model
def test_campaign_resumes_from_its_block_log(tmp_path):
    """A campaign cut short by its budget keeps its finished blocks and continues where it
    stopped; a changed spec is refused in the same folder."""

    spec = CampaignSpec(prompts=["HumanEval/3"], arms=["R", "C_QB"], sessions=1, repeats=1, cap=6, threads=1,
                        draft="ngram", ratios=[])
    spec.validate()
    first = run_campaign(spec, tmp_path, budget_s=1e-9)  # one block, then the budget is spent
    assert not first.complete and (first.ran, first.planned, first.outputs) == (1, 2, {})
    res = run_campaign(spec, tmp_path)
    assert res.complete and (res.skipped, res.ran) == (1, 1)
    assert len(res.outputs["records"]) == 2 and all(r["qualified"] for r in res.outputs["records"])
    assert json.loads((tmp_path / "spec.json").read_text())["spec_hash"] == res.spec_hash
    assert len((tmp_path / "blocks.jsonl").read_text().splitlines()) == 2
    spec.cap = 7
    with pytest.raises(ConfigError, match="another campaign"):
        run_campaign(spec, tmp_path)


@pytest.mark.parametrize("field, value, match", [
    ("sessions", "2", "sessions = '2' has the wrong type"), ("draft", 5, "draft = 5 has the wrong type"),
    ("fixed_rows", "false", "fixed_rows = 'false' has the wrong type"), ("k", True, "k = True has the wrong type"),
    ("draft", "none", "the spec names no drafter"), ("gate", "fast", "unknown gate 'fast'"),
    ("gate", 1, "gate = 1 has the wrong type")])
def test_campaign_spec_values_are_checked(field, value, match):
    spec = CampaignSpec(prompts=["HumanEval/3"], arms=["R", "C_QB"])
    setattr(spec, field, value)
    with pytest.raises(ConfigError, match=match):
        spec.validate()


def test_a_campaign_folder_has_one_writer(tmp_path):
    """A second campaign on the same --out is refused before it plans anything (timings never overlap)."""
    from statelab.paths import exclusive_lock

    spec = CampaignSpec(prompts=["HumanEval/3"], arms=["R", "M_QB"], sessions=1, cap=2, threads=1)
    with exclusive_lock(tmp_path / ".lock", ConfigError, "test holder"):
        with pytest.raises(ConfigError, match="in use by another statelab process"):
            run_campaign(spec, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_campaign_hash_follows_what_the_blocks_measured(tmp_path):
    """Analysis-only fields may change in a resumed folder; a prompt file's text may not."""
    from statelab.experiments.campaign import campaign_hash

    f = tmp_path / "p.txt"
    f.write_text("def add(a, b):\n")
    spec = CampaignSpec(prompts=[f"file:{f}"], arms=["R", "M_QB"])
    h = campaign_hash(spec, None)
    for k, v in (("threshold", 1.5), ("seed", 7), ("resamples", 100), ("ratios", [])):
        assert campaign_hash(CampaignSpec(**{**spec.__dict__, k: v}), None) == h
    assert campaign_hash(CampaignSpec(**{**spec.__dict__, "cap": 65}), None) != h
    f.write_text("def sub(a, b):\n")
    assert campaign_hash(spec, None) != h
