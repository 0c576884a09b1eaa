"""The notebook API (statelab.api): the docs/api.md script, Datasets against the raw states."""
import re
import subprocess
import sys

import numpy as np
import pytest

from statelab.api import first_differing_cells
from statelab.kvstate import make_state

from conftest import REPO

pytestmark = pytest.mark.model


def test_first_differing_cells_on_synthetic_states():
    a = make_state(6, 3, 8, v_trans=True, seed=0)
    b = a.copy()
    b.k[1][4, 2] += 1
    b.v[2][5, 3] += 1  # transposed V: feature 5, cell 3
    k, v = first_differing_cells(a, b)
    assert k.tolist() == [-1, 4, -1] and v.tolist() == [-1, -1, 3]


@pytest.fixture(scope="module")
def caps(model, base_config, he, tmp_path_factory):
    from statelab.lab.archive import save_capture
    from statelab.lab.formation import PRESETS
    from statelab.lab.intervene import natural

    d = tmp_path_factory.mktemp("api")
    out = {}
    for s in ("A", "R"):
        c, ep = natural(model, he("HumanEval/2"), PRESETS[s], base_config, 16)
        out[s] = (save_capture(c, d / s), c, ep)
    return out


def test_open_capture_matches_the_stored_state(caps, model):
    import statelab

    path, c, _ = caps["A"]
    ds = statelab.open_capture(path)
    info = model.info
    assert ds["kv"].dims == ("layer", "component", "cell", "kv_head", "head_dim")
    assert ds["kv"].shape == (info.n_layer, 2, c.n_prompt, info.n_head_kv, info.head_dim_k)
    assert ds.position.values.tolist() == list(range(c.n_prompt)) and ds.token.values.tolist() == c.tokens.tolist()
    st = c.state
    np.testing.assert_array_equal(ds["kv"].sel(layer=3, component="K").values.reshape(c.n_prompt, -1), st.k[3])
    v = st.v[7].T if st.v_trans else st.v[7]
    np.testing.assert_array_equal(ds["kv"].sel(layer=7, component="V").values.reshape(c.n_prompt, -1), v)
    assert ds.attrs["identity_model_sha256"] == model.sha256 and ds.attrs["prompt_id"] == "HumanEval/2"
    assert ds.logits.values.tobytes() == c.logits.tobytes()


def test_diff_names_first_layer_and_position(caps):
    import statelab
    from statelab.kvstate import compare

    (pa, ca, _), (pr, cr, _) = caps["A"][:3], caps["R"][:3]
    d = statelab.diff(pa, pr)
    ref = compare(ca.state, cr.state)
    assert d.attrs["first_layer"] == ref.first_differing_layer
    assert int(d["changed_bytes"].sum()) == ref.changed_bytes
    # brute force: the first cell of the first differing layer whose K or V bits differ
    L = ref.first_differing_layer
    vk = (ca.state.k[L] != cr.state.k[L]).any(axis=1)
    vv = (ca.state.v[L] != cr.state.v[L]).any(axis=0 if ca.state.v_trans else 1)
    assert d.attrs["first_position"] == int(np.flatnonzero(vk | vv)[0])
    assert statelab.diff(pa, pa).attrs["first_layer"] == -1


def test_continue_and_cross_return_plain_objects(caps, model):
    import statelab

    (pa, _, nat_a), (pr, _, nat_r) = caps["A"], caps["R"]
    assert statelab.continue_(pa, cap=16, model=model).same(nat_a)
    res = statelab.cross(pa, pr, cap=16, model=model, natural=(nat_a, nat_r))
    assert res.selector.startswith("ALL") and res.changed_bytes > 0
    assert res.klass in ("B", "C", "D") and res.as_dict()["endpoint"]["length"] == res.endpoint.length
    own = statelab.cross(pa, pa, "L0", cap=16, model=model, natural=(nat_a, nat_a))
    assert own.changed_bytes == 0 and own.klass == "D" and own.selected_bytes > 0


def test_docs_api_script_runs(tmp_path):
    text = (REPO / "docs" / "api.md").read_text()
    script = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    env = {"PYTHONPATH": str(REPO), "STATELAB_THREADS": "1", "PATH": "/usr/bin:/bin"}
    import os

    env.update({k: v for k, v in os.environ.items() if k in ("HOME", "XDG_CACHE_HOME", "STATELAB_CACHE")})
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "first differing layer" in r.stdout and "whole cross class" in r.stdout
    assert (tmp_path / "api-demo" / "A" / "manifest.json").is_file()
