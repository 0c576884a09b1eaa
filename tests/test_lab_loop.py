"""The state lab loop on the real model (CPU): codec on real states, shams, crosses, archive errors."""
import json

import numpy as np
import pytest

from statelab.lab.archive import ArchiveError, check_importable, load_capture, manifest_seal, save_capture
from statelab.errors import ConfigError, IdentityError
from statelab.lab.formation import PRESETS, form, parse_schedule
from statelab.lab.intervene import config_of, cross, natural, sham
from statelab.kvstate import KVFormatError, KVState, compare

pytestmark = pytest.mark.model
CAP = 48
# HumanEval/13 (72 tokens) and HumanEval/4 (117 tokens): on CPU (the pinned x86-64-v3 build), A and
# R natural endpoints differ (first at outputs 20 and 6, benchmarks/arm_divergence.py).
DIVERGING = ("HumanEval/13", "HumanEval/4")


@pytest.fixture(scope="module")
def arms(model, base_config, he):
    out = {}
    for task in DIVERGING:
        p = he(task)
        out[task] = {name: natural(model, p, PRESETS[name], base_config, CAP) for name in ("A", "R")}
    return out


@pytest.mark.parametrize("task, schedule", [(t, s) for t in ("HumanEval/2", "HumanEval/0")
                                             for s in ("A", "R", "64+rest@ub16", "ub7")]
                         + [("HumanEval/10", "B")])  # B splits at 128: a prompt longer than that
def test_codec_round_trip_on_real_states(model, base_config, he, schedule, task):
    p = he(task)
    n = len(model.tokenize(p.text))
    sched = parse_schedule(schedule)
    cap_ = form(model, p, sched, base_config)
    st = KVState.parse(cap_.blob)
    assert st.to_bytes() == cap_.blob
    assert st.n_cells == n and st.n_layer == model.n_layer
    assert st.positions.tolist() == list(range(n))


def test_editing_one_k_value_changes_exactly_its_bytes(arms):
    cap_ = arms["HumanEval/13"]["A"][0]
    st = cap_.state.copy()
    st.k[3][10, 7] = np.float16(st.k[3][10, 7]) + np.float16(1.0)
    new = st.to_bytes()
    diff = np.flatnonzero(np.frombuffer(new, np.uint8) != np.frombuffer(cap_.blob, np.uint8))
    off, _ = st.component_offsets()["L3.K"]
    expect = off + (10 * st.k[3].shape[1] + 7) * 2
    assert set(diff.tolist()) <= {expect, expect + 1} and len(diff) >= 1


def test_sham_equals_natural_on_four_prompts(model, base_config, he, arms):
    """Four prompts, A and R: the two of the module's arms (formed once, cap 48) and two more (cap 24)."""
    runs = {(task, name): (pair, CAP) for task, d in arms.items() for name, pair in d.items()}
    for task in ("HumanEval/2", "HumanEval/0"):
        for name in ("A", "R"):
            runs[task, name] = (natural(model, he(task), PRESETS[name], base_config, 24), 24)
    assert len(runs) == 8
    for (task, name), ((c, nat), cap) in runs.items():
        assert sham(model, c, cap).same(nat), f"sham of {task} [{name}] differs from its natural endpoint"


def test_cross_of_a_capture_into_itself_equals_the_sham(arms, model):
    c, _nat = arms["HumanEval/13"]["A"]
    ep, acc = cross(model, c, c, cap=CAP)
    assert ep.same(sham(model, c, CAP))
    assert acc.changed_bytes == 0 and acc.max_abs == 0.0


def test_a_and_r_states_differ_and_whole_cross_carries_the_difference(arms, model):
    found = False
    for task, d in arms.items():
        (ca, ea), (cr, er) = d["A"], d["R"]
        diff = compare(ca.state, cr.state)
        assert not diff.identical and diff.changed_bytes > 0
        if ea.same(er):
            continue
        found = True
        ep, acc = cross(model, ca, cr, cap=CAP)  # A's KV into R's path, R's initial logits
        assert acc.changed_bytes == diff.changed_bytes
        ep_donor_logits, _ = cross(model, ca, cr, logits_from="donor", cap=CAP)
        assert ep_donor_logits.same(ea), f"{task}: A->R with A's logits must reproduce A"
        # with the recipient's logits the first token may differ; the KV decides the rest
        assert ep.same(ea) or ep.tokens[0] != ea.tokens[0], f"{task}: A->R did not reproduce the donor"
    assert found, "no prompt with differing natural A/R endpoints"


def test_archive_round_trip_and_flipped_byte(arms, tmp_path):
    c, _ = arms["HumanEval/13"]["A"]
    d = save_capture(c, tmp_path / "cap")
    back = load_capture(d)
    assert back.blob == c.blob and back.logits.tobytes() == c.logits.tobytes()
    assert back.schedule == c.schedule
    raw = bytearray((d / "kv.bin").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (d / "kv.bin").write_bytes(bytes(raw))
    with pytest.raises(ArchiveError, match="sha256 mismatch for kv.bin"):
        load_capture(d)
    with pytest.raises(ArchiveError, match="already exists"):
        save_capture(c, d)


def test_manifest_of_another_model_is_refused(arms, model, tmp_path):
    c, _ = arms["HumanEval/13"]["A"]
    d = save_capture(c, tmp_path / "cap")
    back = load_capture(d)
    back.identity = dict(back.identity, model_sha256="0" * 64)
    with pytest.raises(IdentityError, match="formed with model"):
        check_importable(back, model, config_of(c))
    other = config_of(c).with_(backend="cpu")
    back2 = load_capture(d)
    back2.identity = dict(back2.identity, backend="cuda")
    with pytest.raises(IdentityError, match="allow-backend"):
        check_importable(back2, model, other)
    check_importable(back2, model, other, allow_other_backend=True)


def test_unsupported_kv_type_and_truncated_blob(arms, model):
    c, _ = arms["HumanEval/13"]["A"]
    with pytest.raises(KVFormatError):
        KVState.parse(c.blob[:-3])
    st = c.state.copy()
    blob = bytearray(st.to_bytes())
    # K type of layer 0 lives right after v_trans and n_layer: set it to Q8_0 (8)
    off = blob.find(np.int32(1).tobytes() + np.uint64(st.k_row_sizes[0]).tobytes())
    blob[off:off + 4] = np.int32(8).tobytes()
    with pytest.raises(KVFormatError, match="(?i)q8_0|type"):
        KVState.parse(bytes(blob))
    with pytest.raises(IdentityError, match="KV types"):
        check_importable(c, model, config_of(c).with_(type_k="f32", type_v="f32"))


def test_schedule_errors(model, base_config, he):
    with pytest.raises(ConfigError, match="at or past the prompt length"):
        form(model, he(2), parse_schedule("200+rest"), base_config)
    with pytest.raises(ConfigError, match="ubatch 0"):
        parse_schedule("ub0")
    with pytest.raises(ConfigError, match="output cap"):
        natural(model, he(2), PRESETS["A"], base_config, 0)
    with pytest.raises(ConfigError, match="output cap"):
        natural(model, he(2), PRESETS["A"], base_config, -3)


def test_cli_capture_diff_cross_nothing_half_written(cli, tmp_path):
    a, r = tmp_path / "a", tmp_path / "r"
    assert cli("capture", a, "-H", "2", "-s", "A").returncode == 0
    assert cli("capture", r, "-H", "2", "-s", "R").returncode == 0
    d = cli("diff", a, r)
    assert d.returncode == 0 and "identical KV: False" in d.stdout
    x = cli("cross", a, r, "--cap", "8", "--json")
    assert x.returncode == 0, x.stderr
    bad = cli("capture", tmp_path / "bad", "-H", "2", "-s", "200+rest")
    assert bad.returncode != 0 and "at or past the prompt length" in bad.stderr
    assert not (tmp_path / "bad").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]


def test_manifest_missing_a_field_is_a_clear_error(arms, tmp_path):
    c, _ = arms["HumanEval/13"]["A"]
    d = save_capture(c, tmp_path / "cap")
    m = json.loads((d / "manifest.json").read_text())
    del m["schedule"]
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArchiveError, match="does not match its seal"):
        load_capture(d)
    m["seal"] = manifest_seal(m)  # resealed: the missing field itself is named
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArchiveError, match="manifest lacks or mangles the field 'schedule'"):
        load_capture(d)
