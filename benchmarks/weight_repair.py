"""Price of the row-by-row weight repair ("+W" layouts, native/patches/0003), qualified arms only.

    .venv/bin/python benchmarks/weight_repair.py [SPEC.toml ...]

Runs `statelab spec campaign` on each spec (default: studies/spec-cpu-weights.toml, SmolLM2,
where QB and QB+W both reproduce R and are timed side by side; studies/spec-cpu-gemma-weights.toml,
Gemma 3 270M Q4_K_M, where only the +W arms can) and writes the qualification and ratio tables
into docs/benchmarks.md (section weight-repair-<backend>).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _report import machine, update_section

from statelab.errors import script_main
from statelab.experiments.campaign import CampaignSpec, run_campaign

DEFAULT = ["studies/spec-cpu-weights.toml", "studies/spec-cpu-gemma-weights.toml"]


def main():
    paths = sys.argv[1:] or DEFAULT
    parts, backend = [], "cpu"
    for sp in paths:
        spec = CampaignSpec.load(sp)
        backend = spec.backend
        with tempfile.TemporaryDirectory() as tmp:
            res = run_campaign(spec, Path(tmp))
        parts.append(f"### {Path(sp).name} (model {spec.model or 'SmolLM2-135M-Instruct Q4_1'})\n\n"
                     + res.outputs["report"].split("\n", 1)[1].replace("## ", "#### "))
    body = (f"Command: `.venv/bin/python benchmarks/weight_repair.py {' '.join(paths)}`  \n{machine()}.\n\n"
            + "\n".join(parts))
    print(body)
    update_section(f"weight-repair-{backend}", f"Price of the weight repair, QB+W ({backend})", body)


if __name__ == "__main__":
    sys.exit(script_main(main))
