"""Study specifications (``studies/*.toml``): parse, validate everything up front, normalise, hash.

Schema (top-level keys)::

    name        = "ci"                          # optional; default: the file stem
    description = "..."                         # optional
    model       = "path/to/model.gguf"          # optional; default: the embedded model
    backend     = "cpu"                         # cpu | cuda | vulkan
    threads     = 1                             # CPU threads of each context (0: all cores)
    n_ctx       = 1024                          # context size
    cap         = 32                            # output cap (generated tokens)
    repeats     = 2                             # independent process repeats per coordinate
    prompts     = ["HumanEval/2", "file:x.txt", "text:..."]
    selectors   = ["EMPTY", "ALL", "L0_V", "my/sel.toml"]   # names on the selector path or .toml paths
    directions  = ["A->R", "R->A"]              # donor->recipient, arm names from [arms]

    [arms]                                      # arm name -> schedule (A, B, C, R or explicit)
    A = "A"
    R = "R"

Every error (malformed TOML, unknown key, missing prompt, unknown selector, a layer
beyond the model, an empty position range, a direction naming an unknown arm, a prompt
too short for a schedule...) is a :class:`StudyError` raised before any cell runs.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

FORMAT = "statelab.study/1"
_TOP_KEYS = ("name", "description", "model", "backend", "threads", "n_ctx", "cap", "repeats", "prompts",
             "selectors", "directions", "arms")
_REQUIRED = ("prompts", "selectors", "directions", "arms")
_ARM_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class StudyError(ConfigError):
    """A study specification or study output folder that cannot be used, stated in one line."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def slug(prompt_id: str) -> str:
    """A folder name for a prompt id (``HumanEval/2`` -> ``HumanEval_2``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", prompt_id).strip("._") or "prompt"


@dataclass(frozen=True)
class Direction:
    donor: str
    recipient: str

    @property
    def label(self) -> str:
        return f"{self.donor}->{self.recipient}"


@dataclass
class StudySpec:
    """A parsed, validated study.  ``normalized`` (and its ``hash``) identify the results:
    everything that can change a cell's outcome, nothing that cannot (paths, worker counts)."""

    path: Path
    name: str
    description: str
    model: str | None
    backend: str
    threads: int
    n_ctx: int
    cap: int
    repeats: int
    prompt_specs: tuple[str, ...]
    prompts: list  # statelab.prompts.Prompt
    arms: dict  # name -> Schedule
    selectors: dict  # name -> statelab.selection.Selector (order kept)
    directions: tuple[Direction, ...]
    selector_dirs: tuple[str, ...]
    model_path: str = ""
    model_sha256: str = ""
    n_layer: int = 0
    extra: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ identity
    @property
    def task_ids(self) -> list[str]:
        return [p.id for p in self.prompts]

    @property
    def selector_names(self) -> list[str]:
        return list(self.selectors)

    @property
    def direction_labels(self) -> list[str]:
        return [d.label for d in self.directions]

    def normalized(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "model_sha256": self.model_sha256,
            "backend": self.backend,
            "threads": self.threads,
            "n_ctx": self.n_ctx,
            "cap": self.cap,
            "repeats": self.repeats,
            "prompts": [{"spec": s, "id": p.id, "sha256": p.sha256} for s, p in zip(self.prompt_specs, self.prompts)],
            "arms": {name: s.as_dict() for name, s in self.arms.items()},
            "selectors": [{"name": n, "terms": s.describe()} for n, s in self.selectors.items()],
            "directions": self.direction_labels,
        }

    @property
    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.normalized(), sort_keys=True).encode()).hexdigest()

    def record(self) -> dict:
        """What OUT/spec.json holds: the hashed normal form plus where things were found."""
        return {
            "format": FORMAT, "spec_hash": self.hash, "normalized": self.normalized(),
            "spec_path": str(self.path), "description": self.description, "model_path": self.model_path,
            "n_layer": self.n_layer, "selector_dirs": list(self.selector_dirs),
            "selector_sources": {n: s.source for n, s in self.selectors.items()},
            "selector_descriptions": {n: s.description for n, s in self.selectors.items()},
        }

    def cell_keys(self) -> list[str]:
        return [cell_key(t, s, d, r) for t in self.task_ids for s in self.selector_names
                for d in self.direction_labels for r in range(self.repeats)]


def cell_key(task: str, selector: str, direction: str, repeat: int) -> str:
    return f"{task}|{selector}|{direction}|{int(repeat)}"


# ---------------------------------------------------------------------- parsing


def _err(path, msg: str) -> StudyError:
    return StudyError(f"study spec {path}: {msg}")


def _str_list(data: dict, key: str, path) -> list[str]:
    v = data[key]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _err(path, f"'{key}' must be a list of strings, got {v!r}")
    if not v:
        raise _err(path, f"'{key}' is empty")
    dup = sorted({x for x in v if v.count(x) > 1})
    if dup:
        raise _err(path, f"'{key}' lists {', '.join(dup)} more than once")
    return list(v)


def _int(data: dict, key: str, default: int, lo: int, path) -> int:
    v = data.get(key, default)
    if not _is_int(v) or v < lo:
        raise _err(path, f"'{key}' must be an integer >= {lo}, got {v!r}")
    return int(v)


def load_spec(path: str | os.PathLike, check_model: bool = True) -> StudySpec:
    """Parse and validate a study spec.  With ``check_model`` the model's GGUF header is
    read (no weights loaded) to check selector layers against its layer count."""
    from .. import prompts as prompts_mod
    from ..formation import parse_schedule
    from ..runtime import BACKENDS
    from ..selection import SelectorError, default_search_dirs, load_selector

    path = Path(path)
    if not path.is_file():
        raise StudyError(f"study spec not found: {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise _err(path, f"malformed TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _err(path, f"cannot read: {e}") from None
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise _err(path, f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(_TOP_KEYS)})")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise _err(path, f"missing required key(s) {', '.join(missing)}")

    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise _err(path, f"'name' must be a non-empty string, got {name!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _err(path, "'description' must be a string")
    model = data.get("model") or None
    if model is not None and not isinstance(model, str):
        raise _err(path, f"'model' must be a path string, got {model!r}")
    if model is not None and not os.path.isabs(model):
        cand = (path.parent / model)
        model = str(cand) if cand.exists() else model
    backend = data.get("backend", "cpu")
    if backend not in BACKENDS:
        raise _err(path, f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    threads = _int(data, "threads", 0, 0, path)
    n_ctx = _int(data, "n_ctx", 1024, 1, path)
    cap = _int(data, "cap", 128, 1, path)
    repeats = _int(data, "repeats", 2, 1, path)

    # prompts: resolved now (a missing prompt fails here)
    prompt_specs = _str_list(data, "prompts", path)
    prompts = []
    for s in prompt_specs:
        spec_s = s
        if s.startswith("file:") and not os.path.isabs(s[5:]) and (path.parent / s[5:]).is_file():
            spec_s = "file:" + str(path.parent / s[5:])
        try:
            prompts.append(prompts_mod.resolve(spec_s))
        except ConfigError as e:
            raise _err(path, f"prompt {s!r}: {e}") from None
    ids = [p.id for p in prompts]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise _err(path, f"prompts {', '.join(dup)} appear more than once")
    slugs = [slug(i) for i in ids]
    if len(set(slugs)) != len(slugs):
        raise _err(path, f"prompt ids {ids} do not map to distinct folder names")

    # arms
    arms_raw = data["arms"]
    if not isinstance(arms_raw, dict) or len(arms_raw) < 2:
        raise _err(path, "'[arms]' must name at least two arms, e.g. A = \"A\" and R = \"R\"")
    arms = {}
    for arm, sched in arms_raw.items():
        if not _ARM_RE.match(arm):
            raise _err(path, f"arm name {arm!r} must be letters, digits or underscore (starting with a letter)")
        if not isinstance(sched, str):
            raise _err(path, f"arm {arm}: schedule must be a string like \"A\", \"R\" or \"128+rest@ub64\"")
        try:
            arms[arm] = parse_schedule(sched)
        except ConfigError as e:
            raise _err(path, f"arm {arm}: {e}") from None

    # directions
    dirs = []
    for d in _str_list(data, "directions", path):
        parts = [x.strip() for x in d.split("->")]
        if len(parts) != 2 or not all(parts):
            raise _err(path, f"direction {d!r} must read DONOR->RECIPIENT, e.g. \"A->R\"")
        donor, recip = parts
        for a in (donor, recip):
            if a not in arms:
                raise _err(path, f"direction {d!r} names arm {a!r}, which [arms] does not define "
                                 f"(arms: {', '.join(arms)})")
        if donor == recip:
            raise _err(path, f"direction {d!r} has the same donor and recipient")
        dirs.append(Direction(donor, recip))
    labels = [x.label for x in dirs]
    if len(set(labels)) != len(labels):
        raise _err(path, "a direction is listed twice")

    # selectors: loaded now (unknown names, malformed files, empty ranges fail here)
    search = [str(x) for x in default_search_dirs()]
    if str(path.parent / "selectors") not in search and (path.parent / "selectors").is_dir():
        search.insert(0, str(path.parent / "selectors"))
    selectors = {}
    for s in _str_list(data, "selectors", path):
        target = s
        if (s.endswith(".toml") or "/" in s) and not os.path.isabs(s) and (path.parent / s).is_file():
            target = str(path.parent / s)
        try:
            sel = load_selector(target, search_dirs=search)
        except SelectorError as e:
            raise _err(path, str(e)) from None
        if sel.name in selectors:
            raise _err(path, f"two selectors are named {sel.name!r}")
        src = sel.source
        selectors[sel.name] = sel
        if src is None:
            raise _err(path, f"selector {s!r} has no source file")

    spec = StudySpec(path=path.resolve(), name=name.strip(), description=description, model=model, backend=backend,
                     threads=threads, n_ctx=n_ctx, cap=cap, repeats=repeats, prompt_specs=tuple(prompt_specs),
                     prompts=prompts, arms=arms, selectors=selectors, directions=tuple(dirs),
                     selector_dirs=tuple(search))
    if check_model:
        check_against_model(spec)
    return spec


def check_against_model(spec: StudySpec) -> None:
    """Resolve the model file, read its header (identity, layer count) and check every
    selector's layer indices against it."""
    from ..errors import ModelError
    from ..models import read_model_info
    from ..selection import SelectorError

    try:
        info = read_model_info(spec.model)
    except (ModelError, ConfigError) as e:
        raise _err(spec.path, str(e)) from None
    spec.model_path = info.path
    spec.model_sha256 = info.sha256
    spec.n_layer = info.n_layer
    for sel in spec.selectors.values():
        try:
            sel.validate(info.n_layer)
        except SelectorError as e:
            raise _err(spec.path, str(e)) from None


def check_prompts_fit(spec: StudySpec, model) -> dict[str, int]:
    """Tokenize every prompt with the loaded model; refuse prompts longer than n_ctx or too
    short for an arm's schedule.  Returns prompt id -> token count."""
    out = {}
    for p in spec.prompts:
        n = len(model.tokenize(p.text))
        if n > spec.n_ctx:
            raise _err(spec.path, f"prompt {p.id} has {n} tokens, more than n_ctx={spec.n_ctx}")
        for arm, sched in spec.arms.items():
            try:
                sched.submissions(n)
            except ConfigError as e:
                raise _err(spec.path, f"prompt {p.id} ({n} tokens), arm {arm}: {e}") from None
        out[p.id] = n
    return out


__all__ = ["FORMAT", "Direction", "StudyError", "StudySpec", "cell_key", "check_against_model",
           "check_prompts_fit", "load_spec", "slug"]
