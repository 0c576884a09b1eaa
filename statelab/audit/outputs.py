"""The files an audit writes into its ``--out`` folder: ``report.md`` and a NetCDF Dataset,
each written atomically."""
from __future__ import annotations

from pathlib import Path

from statelab.paths import atomic_write_netcdf, atomic_write_text


def write_report(out, md: str, ds=None, name: str = "results.nc") -> list[Path]:
    """``out/report.md`` and, with a Dataset, ``out/<name>``; the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", md)
    if ds is None:
        return [out / "report.md"]
    atomic_write_netcdf(out / name, ds)
    return [out / "report.md", out / name]


__all__ = ["write_report"]
