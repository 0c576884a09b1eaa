"""A campaign's ratios from its block records, finished or not: the campaign's own estimator
(``statelab.experiments.campaign.contrasts``: per session, the mean over prompts of
log(num / den), a percentile bootstrap over sessions; a prompt enters a session where both arms
ran) and its drafting summary, for a campaign whose device time ran out before its last blocks:

    python benchmarks/campaign_ratios.py SPEC BLOCKS_JSONL[.gz]
    python benchmarks/campaign_ratios.py docs/vulkan/qb/spec-vulkan-ngram.toml docs/vulkan/qb/blocks.jsonl.gz
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from statelab.errors import script_main
from statelab.experiments.campaign import CampaignSpec, contrasts, drafter_summary
from statelab.experiments.spec_run import qualify_records


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: campaign_ratios.py SPEC BLOCKS_JSONL[.gz]", file=sys.stderr)
        return 2
    spec = CampaignSpec.load(argv[0], check_fit=False)
    path = Path(argv[1])
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        blocks = [json.loads(line) for line in f if line.strip()]
    records = qualify_records([r for b in blocks for r in b["records"]])
    arms = sorted({r["arm"] for r in records})
    print(f"{len(blocks)} blocks, {len(records)} records: " + ", ".join(
        f"{a} {sum(r['arm'] == a for r in records)} ({sum(r['qualified'] is True for r in records if r['arm'] == a)} "
        "qualified)" for a in arms))
    for row in contrasts(records, spec.ratios, spec.threshold, spec.seed, spec.resamples):
        print(f"{row['ratio']}: " + (f"{row['estimate']:.3f} [{row['lower']:.3f}, {row['upper']:.3f}], "
                                     f"{row['sessions']} sessions" if row["qualified"] else row["note"]))
    for a in arms:
        if a != "R":
            s = drafter_summary(records, a)
            print(f"{a}: {s['tokens_per_call']:.2f} committed tokens per verify call, acceptance "
                  f"{s['acceptance']:.3f}, {s['ms_per_cycle']:.2f} ms per cycle, shares "
                  + ", ".join(f"{k} {v:.1%}" for k, v in s["shares"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
