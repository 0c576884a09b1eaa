"""A study small enough to run many times in a test: one short text prompt, arms A and R."""
from __future__ import annotations

import json

PROMPT = "def add(a, b):"


def tiny_study(name: str = "tiny", cap: int = 4, selectors=("ALL",), directions=("A->R",)) -> str:
    """The TOML text of the study."""
    return (f'name = "{name}"\nbackend = "cpu"\nthreads = 1\nn_ctx = 256\ncap = {cap}\nrepeats = 1\n'
            f'prompts = {json.dumps(["text:" + PROMPT])}\nselectors = {json.dumps(list(selectors))}\n'
            f'directions = {json.dumps(list(directions))}\n\n[arms]\nA = "A"\nR = "R"\n')
