"""``chat:`` prompts are rendered where the model is loaded for the run, never when a spec is
validated: validating a spec with a ``chat:`` prompt checks the message file and the model's
template from the GGUF header without importing llama_cpp; a spec's identity holds the
message and the template's sha256, so a run resumed after the template changed is refused;
the rendered text's sha256 is recorded by the run."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from statelab.errors import ConfigError, ModelError

REPO = Path(__file__).resolve().parents[1]


def test_validating_a_spec_with_a_chat_prompt_does_not_import_llama_cpp(tmp_path):
    """A new interpreter validates a study spec (findings-ci: a chat: prompt, model checked
    against its GGUF header) and a campaign spec with a chat: prompt; llama_cpp stays unimported."""
    code = f"""
import json, sys
from statelab.experiments.matrix import load_spec
from statelab.experiments.campaign import CampaignSpec
s = load_spec({str(REPO / "studies" / "findings-ci.toml")!r})
c = CampaignSpec(prompts=["HumanEval/2", "chat:{REPO / 'prompts' / 'findings' / 'long-story.txt'}"], arms=["R", "C_QB"],
                 draft="ngram")
c.validate()
print(json.dumps({{"llama_cpp": "llama_cpp" in sys.modules, "ids": [p.id for p in s.prompts], "hash": s.hash}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ids"] == ["HumanEval/4", "chat:long-story.txt"]  # studies/findings-ci.toml
    assert got["llama_cpp"] is False


def test_a_chat_prompt_is_checked_without_rendering(tmp_path):
    from statelab import prompts

    with pytest.raises(ConfigError, match="prompt file not found"):
        prompts.resolve(f"chat:{tmp_path / 'missing.txt'}")
    f = tmp_path / "m.txt"
    f.write_text("Hello there")
    p = prompts.resolve(f"chat:{f}")
    assert "text" not in p.__dict__  # nothing rendered yet
    q = dataclasses.replace(p, template_sha256="0" * 64)  # the same message under another template
    assert q.identity != p.identity and q.id == p.id
    assert dataclasses.replace(p, message="Hello").identity != p.identity
    assert prompts.resolve(f"chat:{f}").identity == p.identity  # stable
    assert prompts.resolve("HumanEval/2").identity == prompts.resolve("HumanEval/2").sha256  # others: their text


def test_a_model_without_a_template_is_refused_at_validation(tmp_path, monkeypatch):
    from statelab import models, prompts

    f = tmp_path / "m.txt"
    f.write_text("Hello there")
    info = models.read_model_info(None)
    monkeypatch.setattr(models, "read_model_info", lambda m=None: dataclasses.replace(info, chat_template_sha256=""))
    with pytest.raises(ModelError, match="carries no chat template"):
        prompts.resolve(f"chat:{f}")


@pytest.mark.model
def test_the_run_renders_records_and_refuses_a_changed_template(tmp_path, monkeypatch):
    """A partition sweep of a chat: prompt: the unit (a fresh process with the model loaded)
    records the rendered text's sha256, the one llama.cpp renders here; after the model's
    template changed (its header's sha256), the same run in the same folder is refused."""
    from statelab import models, prompts
    from statelab.experiments.partition import PartitionSpec, run_partition

    f = tmp_path / "m.txt"
    f.write_text("Name one prime number.")
    spec = lambda: PartitionSpec([f"chat:{f}"], "sweep", schedules="A", cap=2, threads=1)  # noqa: E731
    res = run_partition(spec(), tmp_path / "run")
    p = prompts.resolve(f"chat:{f}")
    (entry,) = [json.loads(ln) for ln in (tmp_path / "run" / "units.jsonl").read_text().splitlines()]
    assert entry["prompt_sha256"] == p.sha256 != p.identity  # rendered by the unit, as here
    assert "Name one prime number." in p.text and res.outputs["records"][0]["prompt"] == "chat:m.txt"
    assert run_partition(spec(), tmp_path / "run").skipped == 1  # the same template: resumed

    info = models.read_model_info(None)
    monkeypatch.setattr(models, "read_model_info", lambda m=None: dataclasses.replace(info, chat_template_sha256="1" * 64))
    with pytest.raises(ConfigError, match="different spec"):
        run_partition(spec(), tmp_path / "run")
