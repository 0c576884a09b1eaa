"""The one reader of every kind's ``results.nc`` (study, frontier run, campaign, demo parts):
the file loaded whole into memory and closed, string variables as numpy strings."""
from __future__ import annotations

import os

import xarray as xr


def load_results(path: str | os.PathLike) -> xr.Dataset:
    """Load a results file (written by :func:`statelab.paths.atomic_write_netcdf`) fully into memory (file closed)."""
    with xr.open_dataset(path, engine="netcdf4") as f:
        ds = f.load()
    for name in list(ds.variables):
        if ds[name].dtype == object:
            values = ds[name].values.astype(str)
            if name in ds.coords:
                ds = ds.assign_coords({name: (ds[name].dims, values)})
            else:
                ds[name] = (ds[name].dims, values, ds[name].attrs)
    return ds
