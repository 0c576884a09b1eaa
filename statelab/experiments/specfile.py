"""What study specs (:mod:`statelab.experiments.matrix.spec`) and frontier specs (:mod:`statelab.experiments.frontier_panels`)
share: reading the TOML file, the top-level key check and the fields both kinds have.

Every problem is reported through ``err(msg)``, a callable that builds the calling module's
own one-line error (``<kind> <path>: <msg>``, see :func:`spec_error`); the messages are the
same for both kinds of spec.
"""
from __future__ import annotations

import glob
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from statelab import prompts as prompts_mod
from statelab.errors import ConfigError, ModelError
from statelab.experiments.naming import Direction
from statelab.lab.formation import parse_schedule
from statelab.models import read_model_info
from statelab.runtime.native import check_backend
from statelab.selection import SelectorError, default_search_dirs, load_selector

Err = Callable[[str], Exception]
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")  # arm (and panel) names


@dataclass
class SpecCommon:
    """What every experiment spec holds once read (:func:`common_fields` and the loaders):
    the kinds' spec classes add their own fields after these."""
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
    directions: tuple[Direction, ...]

    @property
    def direction_labels(self) -> list[str]:
        return [d.label for d in self.directions]


def spec_error(error: type[Exception], kind: str, path, msg: str) -> Exception:
    """``error("<kind> <path>: <msg>")``, the form of every problem inside a spec file."""
    return error(f"{kind} {path}: {msg}")


def load_toml_spec(path: Path, kind: str, error: type[Exception], top_keys: Sequence[str],
                   required: Sequence[str]) -> dict:
    """Read and parse the TOML file at ``path``; refuse unknown top-level keys and missing
    required ones.  Errors are ``error`` instances naming the spec as ``kind``."""
    return check_keys(read_toml(path, kind, error), path, kind, error, top_keys, required)


def read_toml(path: Path, kind: str, error: type[Exception]) -> dict:
    """The TOML file at ``path`` as data; a missing, unreadable or malformed file is one
    ``error`` naming the spec as ``kind``."""
    if not path.is_file():
        raise error(f"{kind} not found: {path}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise spec_error(error, kind, path, f"malformed TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise spec_error(error, kind, path, f"cannot read: {e}") from None


def check_keys(data: dict, path: Path, kind: str, error: type[Exception], top_keys: Sequence[str],
               required: Sequence[str]) -> dict:
    """Refuse unknown top-level keys and missing required ones (a spec read from TOML or built
    by a program alike)."""
    unknown = sorted(set(data) - set(top_keys))
    if unknown:
        raise spec_error(error, kind, path, f"unknown key(s) {', '.join(unknown)} (allowed: {', '.join(top_keys)})")
    missing = [k for k in required if k not in data]
    if missing:
        raise spec_error(error, kind, path, f"missing required key(s) {', '.join(missing)}")
    return data


def name_description_model(data: dict, path: Path, err: Err) -> tuple[str, str, str | None]:
    """``name`` (default: the file stem; returned stripped), ``description`` and ``model``
    (a relative path that exists next to the spec is taken relative to it)."""
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise err(f"'name' must be a non-empty string, got {name!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise err("'description' must be a string")
    model = data.get("model") or None
    if model is not None:
        if not isinstance(model, str):
            raise err(f"'model' must be a path string, got {model!r}")
        if not os.path.isabs(model) and (path.parent / model).exists():
            model = str(path.parent / model)
    return name.strip(), description, model


def common_fields(data: dict, path: Path, err: Err, cap_default: int) -> dict:
    """The fields every spec has, checked in this order: name, description, model, backend,
    threads, n_ctx, cap, repeats (keyword arguments of both spec dataclasses)."""
    name, description, model = name_description_model(data, path, err)
    return {"name": name, "description": description, "model": model, "backend": backend_field(data, err),
            "threads": int_field(data, "threads", 0, 0, err), "n_ctx": int_field(data, "n_ctx", 1024, 1, err),
            "cap": int_field(data, "cap", cap_default, 1, err), "repeats": int_field(data, "repeats", 2, 1, err)}


def backend_field(data: dict, err: Err) -> str:
    try:
        return check_backend(data.get("backend", "cpu"))
    except ConfigError as e:
        raise err(str(e)) from None


def int_field(data: dict, key: str, default: int, lo: int, err: Err) -> int:
    v = data.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise err(f"'{key}' must be an integer >= {lo}, got {v!r}")
    return int(v)


def str_list(data: dict, key: str, err: Err, *, say_empty: bool = False) -> list[str]:
    """A non-empty list of distinct strings.  An empty list fails as "'KEY' is empty" with
    ``say_empty``, otherwise as not being a non-empty list of strings."""
    v = data[key]
    if say_empty:
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise err(f"'{key}' must be a list of strings, got {v!r}")
        if not v:
            raise err(f"'{key}' is empty")
    elif not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise err(f"'{key}' must be a non-empty list of strings, got {v!r}")
    dup = sorted({x for x in v if v.count(x) > 1})
    if dup:
        raise err(f"'{key}' lists {', '.join(dup)} more than once")
    return list(v)


def resolve_prompts(prompt_specs: Sequence[str], path: Path, err: Err, model=None, backend: str = "cpu") -> list:
    """:func:`statelab.prompts.resolve` each prompt spec (``file:`` and ``chat:`` paths relative
    to the spec file when they exist there; ``chat:`` rendered with ``model``'s template); a
    prompt that cannot be resolved fails here."""
    prompts = []
    for s in prompt_specs:
        target = s
        kind, _, rest = s.partition(":")
        if kind in ("file", "chat") and rest and not os.path.isabs(rest) and (path.parent / rest).is_file():
            target = f"{kind}:{path.parent / rest}"
        try:
            prompts.append(prompts_mod.resolve(target, model, backend))
        except (ConfigError, ModelError) as e:
            raise err(f"prompt {s!r}: {e}") from None
    return prompts


def parse_arms(data: dict, err: Err) -> dict:
    """The ``[arms]`` table: arm name -> :class:`statelab.lab.formation.Schedule`, at least two."""
    arms_raw = data["arms"]
    if not isinstance(arms_raw, dict) or len(arms_raw) < 2:
        raise err("'[arms]' must name at least two arms, e.g. A = \"A\" and R = \"R\"")
    arms = {}
    for arm, sched in arms_raw.items():
        if not NAME_RE.match(arm):
            raise err(f"arm name {arm!r} must be letters, digits or underscore (starting with a letter)")
        if not isinstance(sched, str):
            raise err(f"arm {arm}: schedule must be a string like \"A\", \"R\" or \"128+rest@ub64\"")
        try:
            arms[arm] = parse_schedule(sched)
        except ConfigError as e:
            raise err(f"arm {arm}: {e}") from None
    return arms


def selector_search_dirs(path: Path) -> list[str]:
    """The selector path, with a ``selectors`` folder next to the spec file first."""
    search = [str(x) for x in default_search_dirs()]
    if (path.parent / "selectors").is_dir() and str(path.parent / "selectors") not in search:
        search.insert(0, str(path.parent / "selectors"))
    return search


def expand_selector_patterns(names: Sequence[str], path: Path, err: Err) -> list[str]:
    """Selector entries with glob characters (``*``, ``?``, ``[...]``; e.g.
    ``"../selectors/layers/L*.toml"``, relative to the spec file) stand for every matching
    ``.toml`` file, in sorted order; a pattern that matches nothing is an error."""
    out = []
    for name in names:
        if not any(c in name for c in "*?["):
            out.append(name)
            continue
        base = "" if os.path.isabs(name) else str(path.parent) + os.sep
        found = sorted(f for f in glob.glob(base + name) if f.endswith(".toml") and os.path.isfile(f))
        if not found:
            raise err(f"selector pattern {name!r} matches no .toml file")
        out.extend(found)
    return out


def load_spec_selector(name: str, path: Path, search: list[str], err: Err):
    """A selector named in a spec: a name on ``search`` or a ``.toml`` path (relative to the
    spec file when it exists there)."""
    target = name
    if (name.endswith(".toml") or "/" in name) and not os.path.isabs(name) and (path.parent / name).is_file():
        target = str(path.parent / name)
    try:
        return load_selector(target, search_dirs=search)
    except SelectorError as e:
        raise err(str(e)) from None
    except UnicodeDecodeError as e:
        raise err(f"selector {name!r}: the file is not UTF-8 text ({e.reason} at byte {e.start})") from None


def check_against_model(spec, err: Err) -> None:
    """Read the header of ``spec.model`` (no weights), record its path, sha256 and layer count
    on ``spec`` and check every selector in ``spec.selectors`` against that layer count."""
    try:
        info = read_model_info(spec.model)
    except (ModelError, ConfigError) as e:
        raise err(str(e)) from None
    spec.model_path, spec.model_sha256, spec.n_layer = info.path, info.sha256, info.n_layer
    for sel in spec.selectors.values():
        try:
            sel.validate(info.n_layer)
        except SelectorError as e:
            raise err(str(e)) from None


def check_prompt_fits(prompt_id: str, n: int, n_ctx: int, arms: dict, err: Err, cap: int = 0) -> None:
    """Refuse a prompt of ``n`` tokens that with ``cap`` generated tokens does not fit ``n_ctx``,
    or too short for an arm's schedule (``arms``: arm name -> Schedule)."""
    if n + cap > n_ctx:
        extra = f" + cap {cap} = {n + cap} positions" if cap else " tokens"
        raise err(f"prompt {prompt_id} has {n}{' tokens' if cap else ''}{extra}, more than n_ctx={n_ctx}"
                  + ("; raise n_ctx or lower cap" if cap else ""))
    for arm, sched in arms.items():
        try:
            sched.fitted(n).submissions(n)  # formation raises n_batch to the largest submission
        except ConfigError as e:
            raise err(f"prompt {prompt_id} ({n} tokens), arm {arm}: {e}") from None
