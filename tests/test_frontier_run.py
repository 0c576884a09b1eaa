"""Frontier panels on the real model: traces from independent processes, stored, analysed
again without a model, and bad stored input refused in one line.

HumanEval/86 (133 tokens) on CPU, A vs R, cap 16: the POSITION panel (PREFIX/TAIL) has its
frontier at output 2 (the PREFIX-only arm picks another token than EMPTY, TAIL and BOTH);
the L0 panel has none, since A and R are bitwise identical in layer 0 on CPU.
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import one_line_error, run_cli
from statelab.experiments.frontier_panels import FrontierRunError, load_spec

REPO = Path(__file__).resolve().parents[1]
THREADS = {"STATELAB_THREADS": "1"}

SPEC = """
name = "frontier-test"
backend = "cpu"
threads = 1
cap = 16
repeats = 2
prompts = ["HumanEval/86"]
directions = ["A->R", "R->A"]
panels = ["POSITION", "L0"]
before_frontier = 1

[arms]
A = "A"
R = "R"
"""


# ------------------------------------------------------------------------ spec (no model)


def test_spec_errors_are_one_line(tmp_path, cli):
    bad = tmp_path / "bad.toml"
    bad.write_text(SPEC.replace('panels = ["POSITION", "L0"]', 'panels = ["POSITION", "LAYERS"]'))
    with pytest.raises(FrontierRunError, match="unknown panel 'LAYERS'"):
        load_spec(bad, check_model=False)
    bad.write_text(SPEC.replace("repeats = 2", "repeats = 1"))
    with pytest.raises(FrontierRunError, match="two independent processes"):
        load_spec(bad, check_model=False)
    bad.write_text(SPEC.replace('"A->R"', '"A->X"'))
    one_line_error(cli("frontier", "run", bad, "--out", tmp_path / "o"), "names arm 'X'")


def test_spec_custom_panel_table(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(SPEC.replace('panels = ["POSITION", "L0"]', "").replace("[arms]", '[panels]\nEARLY_LATE = ["EARLY", '
                                                                        '"LATE"]\n\n[arms]'))
    spec = load_spec(p, check_model=False)
    assert spec.panels == {"EARLY_LATE": ("EARLY", "LATE")}
    assert spec.direction_labels == ["A->R", "R->A"]
    assert spec.normalized()["panels"] == [{"name": "EARLY_LATE", "components": ["EARLY", "LATE"],
                                            "terms": [spec.selectors["EARLY"].describe(),
                                                      spec.selectors["LATE"].describe()]}]


# ---------------------------------------------------------------------- real model runs


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("frontier")
    spec = base / "spec.toml"
    spec.write_text(SPEC)
    out = base / "run"
    r = run_cli("frontier", "run", spec, "--out", out, env=THREADS)
    assert r.returncode == 0, r.stderr
    return out, r


@pytest.mark.model
def test_position_panel_two_processes_agree(run_dir):
    from statelab.analysis import frontier as F

    out, r = run_dir
    assert "repeats agree on" in r.stdout
    ds = F.load_results(out / "results.nc")
    assert ds["repeat"].values.tolist() == [0, 1]
    # each repeat came from its own worker process
    pids = {json.loads((out / "traces/HumanEval_86/A-R" / f"r{k}" / "manifest.json").read_text())["pid"]
            for k in (0, 1)}
    assert len(pids) == 2

    pos = ds.sel(task="HumanEval/86", panel="POSITION")
    for rec, d in (("R", "A->R"), ("A", "R->A")):
        cell = pos.sel(recipient=rec, direction=d)
        ts = cell["t_star"].values
        assert ts.tolist() == [6, 6]
        assert (cell["token_a"].values >= 0).all() and (cell["token_b"].values >= 0).all()
        at = cell.sel(position=6)
        for name in ("additive", "joint", "interaction"):
            v = at[name].values
            assert np.isfinite(v).all()
            assert v[0] == v[1]
        assert np.isfinite(at["score"].values).all()
        # the four arms do not all choose the same token at t*
        assert len(set(at["token"].values[0].tolist())) == 2
        assert at["requested"].values.all() and at["complete"].values.all()

    agr = F.score_repeat_agreement(ds)
    assert agr.attrs["n_compared"] >= 2 and agr.attrs["n_agree"] == agr.attrs["n_compared"]
    assert bool(agr["agree"].sel(task="HumanEval/86", panel="POSITION", recipient="R", direction="A->R",
                                 position=6))
    # POSITION direction symmetry: the same four states, so the canonical interaction is the same
    i_ar = float(pos.sel(recipient="R", direction="A->R", position=6, repeat=0)["interaction"])
    i_ra = float(pos.sel(recipient="A", direction="R->A", position=6, repeat=0)["interaction"])
    assert i_ar == i_ra and i_ar != 0.0

    # L0 on CPU: imports change no byte, the four arms are one run, no frontier (cleanly)
    l0 = ds.sel(task="HumanEval/86", panel="L0")
    assert (l0.sel(recipient="R", direction="A->R")["t_star"].values == -1).all()
    m = json.loads((out / "traces/HumanEval_86/A-R/r0/manifest.json").read_text())
    assert len(set(m["panels"]["L0"]["arms"].values())) == 1
    assert all(v["changed_bytes"] == 0 and v["selected_bytes"] > 0 or k == "EMPTY"
               for k, v in m["panels"]["L0"]["imports"].items())
    assert m["panels"]["POSITION"]["imports"]["C1"]["changed_bytes"] > 0

    report = (out / "report.md").read_text()
    assert "no frontier" in report and "| HumanEval/86 | R | POSITION (PREFIX/TAIL) | A->R | 0 | 6 |" in report
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == [
        "HumanEval_86_POSITION_A-R_r0.png", "HumanEval_86_POSITION_R-A_r0.png"]


def _copy(out: Path, dest: Path) -> Path:
    shutil.copytree(out, dest, ignore=shutil.ignore_patterns("results.nc", "report.md", "contrasts.md", "plots",
                                                             "captures"))
    return dest


def _no_native(tmp_path: Path) -> dict:
    """An environment where llama_cpp cannot be imported: analysis must not need it."""
    fake = tmp_path / "nollama" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('frontier analyse must not load llama_cpp')\n")
    return {"PYTHONPATH": str(fake.parent)}


@pytest.mark.model
def test_analyse_reproduces_without_model(run_dir, tmp_path, cli_subprocess):
    from statelab.analysis import frontier as F

    out, _ = run_dir
    copy = _copy(out, tmp_path / "copy")
    r = cli_subprocess("frontier", "analyse", copy, env=_no_native(tmp_path))
    assert r.returncode == 0, r.stderr
    a, b = F.load_results(out / "results.nc"), F.load_results(copy / "results.nc")
    assert a.identical(b)
    assert (copy / "contrasts.md").read_text() == (out / "contrasts.md").read_text()
    assert (copy / "report.md").read_text() == (out / "report.md").read_text()


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _write_manifest(folder: Path, m: dict) -> None:
    """Write an edited manifest resealed, as a consistent forgery would (the seal alone would refuse it)."""
    from statelab.lab.archive import manifest_seal

    m["seal"] = manifest_seal(m)
    (folder / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))


@pytest.mark.model
def test_bad_stored_traces_give_one_line_errors(run_dir, tmp_path, cli, cli_subprocess):
    import hashlib

    out, _ = run_dir
    env = None  # the rest in process: without llama_cpp once here and in test_analyse_reproduces_without_model
    unit = Path("traces/HumanEval_86/A-R/r1")

    # traces of another model mixed into the panel
    c = _copy(out, tmp_path / "model")
    m = _manifest(c / unit)
    m["model_sha256"] = "0" * 64
    _write_manifest(c / unit, m)
    one_line_error(cli_subprocess("frontier", "analyse", c, env=_no_native(tmp_path)),
                   "HumanEval/86 A->R panel POSITION:", "traces of different models mixed in one panel")

    # traces of another prompt mixed into the panel
    c = _copy(out, tmp_path / "prompt")
    m = _manifest(c / unit)
    m["prompt_sha256"] = "f" * 64
    _write_manifest(c / unit, m)
    one_line_error(cli("frontier", "analyse", c, env=env), "traces of different prompts mixed in one panel")

    # a repeat run from other captures
    c = _copy(out, tmp_path / "captures")
    m = _manifest(c / unit)
    m["recipient_kv_sha256"] = "1" * 64
    _write_manifest(c / unit, m)
    one_line_error(cli("frontier", "analyse", c, env=env), "r1: recipient_kv differs from repeat 0",
                   "not run from the same captures")

    # an arm missing from a repeat
    c = _copy(out, tmp_path / "arm")
    m = _manifest(c / unit)
    del m["panels"]["POSITION"]["arms"]["C2"]
    _write_manifest(c / unit, m)
    one_line_error(cli("frontier", "analyse", c, env=env), "repeat 1 lacks arm(s) C2")

    # a whole repeat missing
    c = _copy(out, tmp_path / "repeat")
    shutil.rmtree(c / unit)
    one_line_error(cli("frontier", "analyse", c, env=env), "trace folder missing", "resume")

    # NaN in the stored logits (file rewritten consistently with its manifest hash)
    c = _copy(out, tmp_path / "nan")
    m = _manifest(c / unit)
    rid = m["panels"]["POSITION"]["arms"]["C1"]
    f = c / unit / m["runs"][rid]["file"]
    with np.load(f) as z:
        tokens, logits = z["tokens"], z["logits"].copy()
    logits[1, 7] = np.nan
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=tokens, logits=logits)
    f.write_bytes(buf.getvalue())
    m["files"][f.name] = hashlib.sha256(buf.getvalue()).hexdigest()
    _write_manifest(c / unit, m)
    one_line_error(cli("frontier", "analyse", c, env=env), "non-finite logit (nan)", "repeat 1")

    # a trace edited behind its manifest
    c = _copy(out, tmp_path / "edited")
    f = c / unit / "run0.npz"
    f.write_bytes(f.read_bytes()[:-10] + b"0123456789")
    one_line_error(cli("frontier", "analyse", c, env=env), "sha256 mismatch for run0.npz")

    # not a run folder
    one_line_error(cli("frontier", "analyse", tmp_path / "nowhere", env=env), "not a frontier run folder")


@pytest.mark.model
def test_demo_frontier_section(model):
    from statelab.experiments.demo import frontier_section
    from statelab.runtime import ContextConfig

    md = frontier_section(model, ContextConfig(backend="cpu", n_ctx=1024, n_threads=1), ["HumanEval/86"], cap=8)
    assert md.startswith("## Frontier panels (L0, POSITION; arms A, R, cap 8")
    assert "| HumanEval/86 | R | POSITION (PREFIX/TAIL) | A->R | 0 | 6 |" in md
    assert "HumanEval/86 A->R L0 (L0_K/L0_V) repeat 0: no frontier" in md
    assert "every import is byte-identical to the recipient's KV" in md
    assert "FAILED CONTROL" not in md


@pytest.mark.model
def test_rerun_resumes_and_other_spec_is_refused(run_dir, tmp_path, cli):
    from statelab.analysis import frontier as F

    out, _ = run_dir
    before = F.load_results(out / "results.nc")
    r = cli("frontier", "run", out.parent / "spec.toml", "--out", out, env=THREADS)
    assert r.returncode == 0, r.stderr
    assert "0 worker(s) run, 4 already done" in r.stdout
    assert before.identical(F.load_results(out / "results.nc"))

    other = tmp_path / "other.toml"
    other.write_text(SPEC.replace("cap = 16", "cap = 12"))
    one_line_error(cli("frontier", "run", other, "--out", out, env=THREADS), "holds a frontier run of a different spec")
