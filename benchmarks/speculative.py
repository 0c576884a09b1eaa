"""Speculative request-time ratios on this machine, qualified arms only.

    .venv/bin/python benchmarks/speculative.py [studies/spec-cpu.toml]

Runs `statelab spec campaign` (fresh worker process per block, counterbalanced order,
sessions, percentile bootstrap of session log contrasts) and writes its qualification and
ratio tables into docs/benchmarks.md.  Goals from the issue: C_PQ/C_QB >= 1.05,
C_GS/C_QB >= 1.5, C_QB/M0 <= 1.10, R/C_QB > 1; an arm that does not reproduce R is not timed.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _report import machine, update_section

from statelab.campaign import CampaignSpec, run_campaign


def main():
    spec_path = Path(sys.argv[1] if len(sys.argv) > 1 else "studies/spec-cpu.toml")
    spec = CampaignSpec.load(spec_path)
    with tempfile.TemporaryDirectory() as tmp:
        res = run_campaign(spec, Path(tmp))
    body = (f"Command: `.venv/bin/python benchmarks/speculative.py {spec_path}`  \n{machine()}.\n\n"
            + res["report"].split("\n", 1)[1].replace("## ", "#### "))
    print(body)
    update_section(f"speculative-{spec.backend}", f"Speculative arms ({spec.backend})", body)


if __name__ == "__main__":
    main()
