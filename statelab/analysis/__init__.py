"""Analyses that need no model: endpoint and trajectory classes, lattices, separability,
bootstrap (:mod:`.classes`) and frontier contrasts and scores (:mod:`.frontier`).
Works on numpy / xarray objects; calls no runtime."""
