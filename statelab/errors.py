"""Errors that statelab reports to users as one clear line (the CLI prints them without a traceback)."""


class StatelabError(Exception):
    """Base class: a problem with the user's input or environment, stated plainly."""


class NativeBuildError(StatelabError):
    """The patched llama.cpp build is missing or broken."""


class ModelError(StatelabError):
    """A model file is missing, not GGUF, or unsupported."""


class ConfigError(StatelabError):
    """A configuration value is invalid (backend, context sizes, schedules, caps...)."""


class DecodeError(StatelabError):
    """llama_decode (or a state import) failed."""


class IdentityError(StatelabError):
    """A capture or archive does not belong to the model, geometry or backend it is used with."""


def one_of(names) -> str:
    """``"a, b or c"``: the valid choices in a message or a help text."""
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
