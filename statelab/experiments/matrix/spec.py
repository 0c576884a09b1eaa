"""Study specifications (``studies/*.toml``): parse, validate everything up front, normalise, hash.

Schema (top-level keys)::

    name        = "ci"                          # optional; default: the file stem
    description = "..."                         # optional
    model       = "path/to/model.gguf"          # optional; default: the embedded model
    backend     = "cpu"                         # cpu | cuda | vulkan
    threads     = 1                             # CPU threads of each context (0: all cores)
    n_ctx       = 1024                          # context size
    cap         = 32                            # output cap (generated tokens); required
    repeats     = 2                             # independent process repeats per coordinate
    prompts     = ["HumanEval/2", "file:x.txt", "chat:msg.txt", "text:..."]
    selectors   = ["EMPTY", "ALL", "L0_V", "my/sel.toml", "../selectors/layers/*.toml"]
                  # names on the selector path, .toml paths, or glob patterns (sorted matches)
    directions  = ["A->R", "R->A"]              # donor->recipient, arm names from [arms]

    [arms]                                      # arm name -> schedule (A, B, C, R or explicit)
    A = "A"
    R = "R"

Every error (malformed TOML, unknown key, missing prompt, unknown selector, a layer
beyond the model, an empty position range, a direction naming an unknown arm, a prompt
too short for a schedule...) is a :class:`StudyError` raised before any cell runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from statelab.errors import ConfigError
from statelab.experiments import specfile as sf
from statelab.experiments.folder import normalized_hash
from statelab.experiments.naming import Direction, parse_directions, slug
from statelab.experiments.specfile import SpecCommon, check_against_model as check, check_prompt_fits, spec_error
from statelab.resources import spec_file

FORMAT = "statelab.study/1"
_TOP_KEYS = ("name", "description", "model", "backend", "threads", "n_ctx", "cap", "repeats", "prompts",
             "selectors", "directions", "arms")
_REQUIRED = ("cap", "prompts", "selectors", "directions", "arms")  # cap decides every endpoint: never implied


class StudyError(ConfigError):
    """A study specification or study output folder that cannot be used, stated in one line."""



@dataclass
class StudySpec(SpecCommon):
    """A parsed, validated study.  ``normalized`` (and its ``hash``) identify the results:
    everything that can change a cell's outcome, nothing that cannot (paths, worker counts)."""

    selectors: dict  # name -> statelab.selection.Selector (order kept)
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
            "prompts": [{"spec": s, "id": p.id, "sha256": p.identity} for s, p in zip(self.prompt_specs, self.prompts)],
            "arms": {name: s.as_dict() for name, s in self.arms.items()},
            "selectors": [{"name": n, "terms": s.describe()} for n, s in self.selectors.items()],
            "directions": self.direction_labels,
        }

    @property
    def hash(self) -> str:
        return normalized_hash(self.normalized())

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
    return spec_error(StudyError, "study spec", path, msg)


def load_spec(path: str | os.PathLike, check_model: bool = True) -> StudySpec:
    """Parse and validate a study spec.  With ``check_model`` the model's GGUF header is
    read (no weights loaded) to check selector layers against its layer count."""
    path = spec_file(path)
    data = sf.load_toml_spec(path, "study spec", StudyError, _TOP_KEYS, _REQUIRED)
    return spec_from_data(data, path, check_model)


def spec_from_data(data: dict, path: str | os.PathLike, check_model: bool = True) -> StudySpec:
    """Validate a study spec given as data (what the TOML file holds), e.g. one a program
    builds; ``path`` stands for the spec file: relative names (selectors, model, prompt
    files) are looked up beside it and errors name it."""
    path = Path(path)
    sf.check_keys(data, path, "study spec", StudyError, _TOP_KEYS, _REQUIRED)

    def err(msg: str) -> StudyError:
        return _err(path, msg)

    common = sf.common_fields(data, path, err, cap_default=128)

    # prompts: resolved now (a missing prompt fails here)
    prompt_specs = sf.str_list(data, "prompts", err, say_empty=True)
    prompts = sf.resolve_prompts(prompt_specs, path, err, common["model"], common["backend"])
    ids = [p.id for p in prompts]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise err(f"prompts {', '.join(dup)} appear more than once")
    slugs = [slug(i) for i in ids]
    if len(set(slugs)) != len(slugs):
        raise err(f"prompt ids {ids} do not map to distinct folder names")

    arms = sf.parse_arms(data, err)

    dirs = parse_directions(sf.str_list(data, "directions", err, say_empty=True), arms, err)

    # selectors: loaded now (unknown names, malformed files, empty ranges fail here)
    search = sf.selector_search_dirs(path)
    selectors = {}
    for s in sf.expand_selector_patterns(sf.str_list(data, "selectors", err, say_empty=True), path, err):
        sel = sf.load_spec_selector(s, path, search, err)
        if sel.name in selectors:
            raise err(f"two selectors are named {sel.name!r}")
        src = sel.source
        selectors[sel.name] = sel
        if src is None:
            raise err(f"selector {s!r} has no source file")

    spec = StudySpec(path=path.resolve(), **common, prompt_specs=tuple(prompt_specs), prompts=prompts, arms=arms,
                     selectors=selectors, directions=tuple(dirs), selector_dirs=tuple(search))
    if check_model:
        check_against_model(spec)
    return spec


def check_against_model(spec: StudySpec) -> None:
    """Resolve the model file, read its header (identity, layer count) and check every
    selector's layer indices against it."""
    check(spec, lambda msg: _err(spec.path, msg))


def check_prompts_fit(spec: StudySpec, model) -> dict[str, int]:
    """Tokenize every prompt with the loaded model; refuse prompts longer than n_ctx or too
    short for an arm's schedule.  Returns prompt id -> token count."""
    out = {}
    for p in spec.prompts:
        n = len(model.tokenize(p.text))
        check_prompt_fits(p.id, n, spec.n_ctx, spec.arms, lambda msg: _err(spec.path, msg), spec.cap)
        out[p.id] = n
    return out


__all__ = ["FORMAT", "Direction", "StudyError", "StudySpec", "cell_key", "check_against_model",
           "check_prompts_fit", "load_spec", "normalized_hash", "slug"]
