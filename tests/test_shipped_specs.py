"""The specs that come with statelab (``studies/``) are found by their documented names from any
folder: ``studies/ci.toml``, ``ci.toml`` or ``ci`` name the shipped file where no such file
exists in the working folder (``resources.spec_file``); a file that exists is read as given."""
from __future__ import annotations

import pytest

from statelab.errors import ConfigError
from statelab.resources import data_dir, spec_file


def test_documented_names_find_the_shipped_specs_from_another_folder(tmp_path, monkeypatch):
    from statelab.experiments.campaign import CampaignSpec
    from statelab.experiments.frontier_panels import load_spec as load_frontier
    from statelab.experiments.matrix import StudyError, load_spec

    monkeypatch.chdir(tmp_path)
    studies = data_dir("studies")
    for name in ("studies/ci.toml", "ci.toml", "ci"):
        assert spec_file(name) == studies / "ci.toml"
    assert load_spec("studies/ci.toml", check_model=False).path == (studies / "ci.toml").resolve()
    assert load_frontier("studies/frontier-ci.toml", check_model=False).name == "frontier-ci"
    assert CampaignSpec.load("studies/spec-cpu.toml", check_fit=False).prompts
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "ci.toml").write_text('name = "mine"\n')  # a file here is read, never the shipped one
    assert spec_file("studies/ci.toml").resolve() == (tmp_path / "studies" / "ci.toml").resolve()
    with pytest.raises(StudyError, match="lacks|missing|required"):
        load_spec("studies/ci.toml", check_model=False)
    for missing in ("studies/nothing.toml", "elsewhere/ci.toml", str(tmp_path / "ci.toml")):
        assert spec_file(missing) == type(spec_file(missing))(missing)
    with pytest.raises(ConfigError, match="not found"):
        CampaignSpec.load("studies/nothing.toml", check_fit=False)
