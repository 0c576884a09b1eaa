"""Where the data folders that come with statelab lie: ``selectors/``, ``studies/`` and the
``prompts/`` the studies name.

In a checkout (and an editable install) they are the repository's top-level folders beside the
package.  A built install (``pip install .``) carries copies inside the package, under
``statelab/_data/NAME`` (``setup.py``'s build step puts them there), so ``statelab`` run from
any folder finds them; the studies' relative paths (``../selectors/...``, ``../prompts/...``)
hold in both places."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DATA_DIRS = ("selectors", "studies", "prompts")


def data_dir(name: str) -> Path:
    """The folder ``name`` (one of :data:`DATA_DIRS`) of this statelab: the installed copy
    when the package carries one, else the checkout's top-level folder."""
    if name not in DATA_DIRS:
        raise ValueError(f"unknown data folder {name!r}: one of {', '.join(DATA_DIRS)}")
    installed = Path(str(files("statelab") / "_data" / name))
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / name


def spec_file(path) -> Path:
    """A spec file as given; where no such file exists and ``path`` names a spec that comes
    with statelab (``ci``, ``ci.toml`` or ``studies/ci.toml``), that one, so the documented
    commands (``statelab study run studies/ci.toml``) work from any folder."""
    p = Path(path)
    if p.exists() or p.is_absolute() or len(p.parts) > 2 or (len(p.parts) == 2 and p.parts[0] != "studies"):
        return p
    shipped = data_dir("studies") / (p.name if p.suffix == ".toml" else p.name + ".toml")
    return shipped if shipped.is_file() else p
