"""Vocabularies as types: one parser each (layouts, arms, backends, schedules, directions, drafters)
whose one-line message is built from its one list; each attention layout one object the audits
iterate; admission as a runtime fact (no xarray on its path); one slug."""
import subprocess
import sys

import pytest

from statelab.audit.oracles import ADDRESS_MODELS, address_model, check_qb_addressing, fixtures
from statelab.errors import ConfigError, StatelabError, one_of
from statelab.experiments.naming import Direction, parse_directions
from statelab.lab.formation import PRESETS, differing_arms, parse_schedule
from statelab.paths import slug
from statelab.runtime.layouts import (ATTENTION, ATTENTION_LAYOUTS, FAMILIES, FAMILY_LAYOUTS, LAYOUTS, Layout,
                                      LayoutError, attention, parse_family)
from statelab.runtime.native import BACKEND, BACKENDS, backend_info, check_backend
from statelab.speculative import drafters
from statelab.speculative.transaction import ARM_NAMES, SPEC_LAYOUTS, Arm, PhaseGuard


def _one_line(exc, *needles):
    msg = str(exc.value)
    assert isinstance(exc.value, StatelabError) and "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_layout_lists_are_derived_from_the_members():
    assert ATTENTION_LAYOUTS == ("MQ", "PQ", "QB")
    assert FAMILY_LAYOUTS == tuple(x for x in Layout if x is not Layout.GS)
    assert FAMILIES["QB+W"] == ("QB", True) and FAMILIES["MQ"] == ("MQ", False)
    assert SPEC_LAYOUTS == (Layout.MQ, Layout.PQ, Layout.QB, Layout.GS, Layout.PQ_W, Layout.QB_W)
    assert sorted(LAYOUTS.values()) == list(range(len(ATTENTION_LAYOUTS)))  # the patch's codes, each once
    # a Layout formats as its name (records, reports and f-strings read "QB+W", never "Layout.QB_W")
    assert f"{Layout.QB_W}" == str(Layout.QB_W) == "QB+W"


def test_one_layout_parser_and_its_messages():
    assert Layout.parse(" qb+w ") is Layout.QB_W and parse_family("pq") == ("PQ", False)
    with pytest.raises(LayoutError) as e:
        Layout.parse("XB")
    _one_line(e, "unknown layout 'XB'", one_of(Layout))
    with pytest.raises(ConfigError) as e:  # a LayoutError is a ConfigError (exit 2)
        attention("GS")
    _one_line(e, "unknown attention layout 'GS'; choose one of MQ, PQ or QB")
    with pytest.raises(ConfigError) as e:
        PhaseGuard("MQ+W", 3)
    _one_line(e, "unknown layout 'MQ+W'", one_of(SPEC_LAYOUTS))


def test_arm_layout_is_a_layout():
    for name in ARM_NAMES:
        arm = Arm.parse(name)
        assert isinstance(arm.layout, Layout) and arm.layout in SPEC_LAYOUTS
    assert Arm.parse("C_QB+W").layout is Layout.QB_W and Arm.parse("C_QB+W").draft
    assert Arm.parse("R").layout is Layout.MQ and Arm.parse("R").reference
    assert PhaseGuard("GS", 2).active("target") is Layout.MQ  # prefill bit off
    with pytest.raises(ConfigError) as e:
        Arm.parse("M_MQ")
    _one_line(e, "unknown arm 'M_MQ'", one_of(ARM_NAMES))


def test_every_attention_layout_is_one_object_with_an_address_model():
    """What the audits iterate: per attention layout its Attention object (ggml operators, native
    order) and its address model; every model passes the address oracle on a quick fixture."""
    assert tuple(a.value for a in ATTENTION) == ATTENTION_LAYOUTS
    assert set(ADDRESS_MODELS) == set(ATTENTION)
    fx = fixtures(quick=True)[0]
    for name in ATTENTION_LAYOUTS:
        assert attention(name).layout == name and attention(name, 1).layout is Layout.MQ
        model = address_model(name)
        assert model.name == name and check_qb_addressing(fx, model).passed


def test_backends_one_table():
    assert BACKENDS == tuple(BACKEND) == ("cpu", "cuda", "vulkan")
    with pytest.raises(ConfigError) as e:
        check_backend("metal")
    _one_line(e, "unknown backend 'metal'; choose one of cpu, cuda or vulkan")
    # the presets that differ per backend: one answer, used by the demo and the frontier panels
    assert list(differing_arms("cpu")) == ["A", "R"] and list(differing_arms("cuda")) == ["A", "B", "C"]
    for b in BACKENDS:
        info = backend_info(b)
        assert set(info.arms) <= set(PRESETS) and len(info.arms) >= 2 and info.tasks and info.matrix_tasks
    from statelab.experiments.demo import arms_for, default_matrix_tasks, default_tasks

    assert arms_for("vulkan") == differing_arms("vulkan")
    assert default_tasks("cpu") == ",".join(backend_info("cpu").tasks)
    assert default_matrix_tasks("cuda") == list(backend_info("cuda").matrix_tasks)


def test_schedule_direction_drafter_messages():
    with pytest.raises(ConfigError) as e:
        parse_schedule("Z")
    _one_line(e, "unknown schedule 'Z'", one_of(PRESETS))
    assert Direction.parse(" A -> R ") == Direction("A", "R")
    with pytest.raises(ConfigError) as e:
        Direction.parse("A-R")
    _one_line(e, "must read DONOR->RECIPIENT")

    def err(msg):
        return ConfigError(f"spec x: {msg}")

    with pytest.raises(ConfigError) as e:
        parse_directions(["A=>R"], ["A", "R"], err)
    _one_line(e, "spec x: direction 'A=>R' must read DONOR->RECIPIENT")
    with pytest.raises(ConfigError) as e:
        drafters.check("bogus")
    _one_line(e, "unknown drafter 'bogus'", *(form for form, _ in drafters.KINDS))


def test_one_slug():
    from statelab.experiments import naming
    from statelab.report import page

    assert naming.slug is slug and slug("HumanEval/2") == "HumanEval_2" and slug("//") == "prompt"
    p = page.Page("t")
    p.add("frontier HumanEval/2 A->R", page.PNG_MAGIC + b"x", "c")
    assert p.figures[0].name == "frontier-HumanEval-2-A--R.png"


def test_admission_path_loads_no_xarray():
    """Whether a device admits a layout is answered by runtime.admission without xarray or report code."""
    code = ("import sys; from statelab.runtime.admission import device_refusal; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('xarray', 'matplotlib') "
            "or m.startswith(('statelab.report', 'statelab.audit'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.model
def test_runtime_admission_on_the_cpu(model):
    from statelab.runtime.admission import AttnShape, device_refusal, operator_admission
    from statelab.runtime.ggml_ops import backend_devices

    cpu = [d for d in backend_devices() if d.type == "CPU"][:1]
    for name in ATTENTION_LAYOUTS:
        ans = operator_admission(AttnShape.of_model(model), name, 4, cpu)
        assert ans["qk"].calls == (4 if name == "PQ" else 1) and ans["qk"].supported == (1,)
        assert (ans["concat"].calls > 0) == (name == "PQ")
    for lay in Layout:  # the CPU runs every layout: nothing to ask
        assert device_refusal(model, lay, 4) is None
