"""No behaviour change: the CI study, the frontier CI panels and the CPU speculative campaign
give the same records and reports (timings, paths, pids and hosts aside) as the golden
files in tests/golden/, made by ``tests/golden_outputs.py`` from the code before the fork
server and the experiment engine (commit 040dab2; all three again at the x86-64-v3 CPU pin,
84c3cba, and spec-ci.json when the campaign became studies/spec-ci.toml, 59882d2).  Run
time on the 2-core machine: ci 36 s and frontier-ci 37 s in the whole suite, spec-ci 107 s alone
(28 timed blocks run one at a time, on one core; spec-cpu's 42 took 289 s alone); the runs start
with the session and run beside the other tests, once per session also on several pytest-xdist
workers (conftest.py)."""
import pytest

from conftest import golden_output
from golden_outputs import STUDIES, assert_golden

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.cli]


@pytest.mark.parametrize("kind", sorted(STUDIES))
def test_outputs_equal_the_golden_files(kind):
    assert_golden(golden_output(kind), kind)


@pytest.mark.parametrize("lanes", [1, 2])
def test_batch_executor_gives_the_golden_study(lanes):
    """The opt-in batch executor (one process per prompt, direction and repeat, one context per
    configuration cleared before each cell; with 2 lanes one process per repeat, two cells at
    once in their own contexts) gives the same records and reports as the golden per-cell
    processes, each of which decoded in a new context."""
    assert_golden(golden_output(f"ci-batch-{lanes}"), "ci", f" under --executor batch --lanes {lanes}")
