"""benchmarks/gate_bound.py: the cheapest plain/drafting schedule is the true minimum (against
enumeration), and on the committed H100 records its pricing reproduces the measured no-gate run."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs/cuda/gates/2026-12-07-h100-c296a4a"


def _module():
    spec = importlib.util.spec_from_file_location("gate_bound", ROOT / "benchmarks/gate_bound.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GB = _module()


def _enumerated(a, plain, draft, change) -> float:
    """The minimum over every schedule, by exhaustive recursion (shape 2: the prefill's)."""
    N = len(a)

    @lru_cache(maxsize=None)
    def rest(n, s):
        if n >= N:
            return 0.0
        p = plain + change * (s != 0) + rest(n + 1, 0)
        d = draft + change * (s != 1) + rest(min(n + 1 + int(a[n]), N), 1)
        return min(p, d)

    return rest(1, 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=2, max_size=14), st.floats(0.5, 2.0), st.floats(1.0, 4.0),
       st.floats(0.0, 5.0))
def test_the_bound_is_the_cheapest_schedule(acc, plain, draft, change):
    a = np.array(acc)
    t, cycles, drafts = GB.best(a, plain, draft, change)
    assert t == pytest.approx(_enumerated(a, plain, draft, change))
    assert 0 <= drafts <= cycles <= len(a) - 1
    # neither pure regime is cheaper than the programme's choice
    assert t <= change + plain * (len(a) - 1) + 1e-9
    assert t <= GB.nogate(a, draft, change)[0] + 1e-9


def test_a_drafting_run_is_taken_only_where_it_pays():
    # one proposal of 7 accepted, at the first cycle; then four tokens where nothing is accepted:
    # staying in the drafting shape costs 4 x 2.0, turning back to plain 3.0 + 4 x 1.0
    a = np.array([0, 7] + [0] * 11)
    t, cycles, drafts = GB.best(a, 1.0, 2.0, 3.0)
    assert (cycles, drafts) == (5, 1) and t == pytest.approx(3.0 + 2.0 + 3.0 + 4 * 1.0)
    t, cycles, drafts = GB.best(a[:10], 1.0, 2.0, 3.0)  # one token left: staying in shape is cheaper
    assert (cycles, drafts) == (2, 2) and t == pytest.approx(3.0 + 2.0 + 2.0)
    t, cycles, drafts = GB.best(np.zeros(10, dtype=int), 1.0, 2.0, 3.0)
    assert (cycles, drafts) == (9, 0) and t == pytest.approx(3.0 + 9.0)


def _table(out: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^\| ([a-z ,]+) \| ([0-9.]+) \|", out, re.M)}


@pytest.mark.model
def test_the_bound_on_the_h100_records_prices_no_gate_as_measured():
    r = subprocess.run([sys.executable, "benchmarks/gate_bound.py", str(RUN / "shadow"), "--nogate", str(RUN / "off"),
                        "--plain-x", "1.067"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    fig = _table(r.stdout)
    assert set(fig) >= {"measured", "shadow gate, replayed", "bound", "nogate, priced", "nogate, measured", "plain only"}
    # the check of the pricing: no gate replayed at the run's prices against no gate measured (3 %)
    assert fig["nogate, priced"] == pytest.approx(fig["nogate, measured"], rel=0.03)
    # "measured" is the campaign's estimator (benchmarks/campaign_ratios.py on the same records: 1.572)
    assert fig["measured"] == pytest.approx(1.572, abs=0.001)
    # the measured gate and both pure regimes are schedules the bound ranges over
    assert fig["bound"] >= max(fig["measured"], fig["nogate, priced"], fig["plain only"])
    # the code's gate replayed at the same prices is one schedule among those the bound ranges over
    assert fig["nogate, priced"] < fig["shadow gate, replayed"] <= fig["bound"]
    # the continuation alone: R's one-token prefill left out, so below the request-time figures
    assert fig["measured, continuation only"] < fig["measured"] and fig["bound, continuation only"] < fig["bound"]
