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


def script_main(fn, *args) -> int:
    """Run a script's ``main`` as the CLI runs a command: a StatelabError is one line
    ``error: ...`` and exit status 2, Ctrl-C one line ``interrupted`` and 130, never a
    traceback; otherwise ``fn``'s own status (None: 0).  For ``sys.exit(script_main(main))``."""
    import sys

    try:
        rc = fn(*args)
    except StatelabError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return rc if isinstance(rc, int) else 0
