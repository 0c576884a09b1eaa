"""The files an audit writes into its ``--out`` folder: ``report.md`` and a NetCDF Dataset,
each written atomically."""
from __future__ import annotations

from pathlib import Path

from statelab.errors import StatelabError
from statelab.paths import atomic_write_netcdf, atomic_write_text, output_lock


def write_report(out, md: str, ds=None, name: str = "results.nc") -> list[Path]:
    """``out/report.md`` and, with a Dataset, ``out/<name>``, as the folder's one writer (a
    second audit writing the same folder at once is refused); the paths written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, StatelabError):
        out.mkdir(exist_ok=True)
        atomic_write_text(out / "report.md", md)
        if ds is None:
            return [out / "report.md"]
        atomic_write_netcdf(out / name, ds)
        return [out / "report.md", out / name]


__all__ = ["write_report"]
