"""A unit in a new interpreter: ``python -m statelab.experiments.worker`` reads
``{"fn": "module:function", "task": {...}}`` (JSON) on stdin and prints one result line
``STATELAB_UNIT <json>`` on stdout.  The unit's function turns every failure it can name
into its own failed result; a crash leaves no result line and the caller records it.
(The fork server runs the same functions in forked children.)"""
from __future__ import annotations

import json
import sys
import time

from statelab.experiments import lifeline
from statelab.experiments.forkserver import resolve

MARKER = "STATELAB_UNIT "
STARTED = "STATELAB_STARTED "  # a batch process took this task (JSON key): see executors.run_batch


def main() -> int:
    lifeline.die_with_parent()  # the runner's kill -9 ends this process too
    t0 = time.perf_counter()
    req = json.loads(sys.stdin.read())
    rec = resolve(req["fn"])(req["task"])
    rec.setdefault("timing", {})["process_s"] = time.perf_counter() - t0
    sys.stdout.write(MARKER + json.dumps(rec) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
