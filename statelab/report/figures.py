"""Figures (matplotlib, Agg, no pyplot state) from xarray results, each returned as PNG bytes.

Every builder makes its own ``Figure`` and drops it after ``savefig``: nothing global is
kept between calls (the soak and long-lived workers build many of them)."""
from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np
import xarray as xr

from statelab.analysis.classes import CLASSES

#: colours of the endpoint classes (B reproduces the donor, C a third trajectory, D keeps the recipient)
CLASS_COLOURS = {"B": "#2b6cb0", "C": "#dd6b20", "D": "#cbd5e0", "": "#ffffff"}
_DPI = 100


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig, tight: bool = True) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight" if tight else None)
    fig.clear()
    return buf.getvalue()


def _message(text: str, width: float = 6.0, height: float = 1.2) -> bytes:
    """A small figure that says why there is nothing to draw (the page keeps its slot)."""
    fig = _figure(width, height)
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, wrap=True)
    return png_bytes(fig, tight=False)


# ----------------------------------------------------------------------------- class matrix


def class_matrix(ds: xr.Dataset, variable: str = "klass", title: str = "") -> bytes:
    """Heatmap of a study's endpoint classes: one row per selector, one column per
    (prompt, direction, repeat), coloured B/C/D with the letter in each cell; withheld,
    failed and pending cells are white with their status initial (w/f/p)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    da = ds[variable].transpose("selector", "task", "direction", "repeat")
    vals = da.values.astype(str)
    n_sel, n_task, n_dir, n_rep = vals.shape
    flat = vals.reshape(n_sel, -1)
    codes = np.select([flat == c for c in CLASSES], range(1, len(CLASSES) + 1), 0)
    status = (ds["status"].transpose("selector", "task", "direction", "repeat").values.astype(str).reshape(n_sel, -1)
              if "status" in ds else np.where(flat == "", "pending", "ok"))
    cols = [(str(t), str(d), int(r)) for t in da.task.values for d in da.direction.values for r in da.repeat.values]
    fig = _figure(max(4.0, 0.55 * len(cols) + 2.2), max(2.2, 0.38 * n_sel + 1.8))
    ax = fig.add_subplot(1, 1, 1)
    cmap = ListedColormap([CLASS_COLOURS[""]] + [CLASS_COLOURS[c] for c in CLASSES])
    ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(CLASSES) + 0.5, aspect="auto", interpolation="nearest")
    for (i, j), v in np.ndenumerate(flat):
        label = v if v else status[i, j][:1]
        ax.text(j, i, label, ha="center", va="center", fontsize=8,
                color="white" if v in ("B", "C") else "black")
    ax.set_yticks(range(n_sel), [str(s) for s in da.selector.values], fontsize=8)
    ax.set_xticks(range(len(cols)), [f"{d} r{r}" for _t, d, r in cols], rotation=60, ha="right", fontsize=7)
    per_task = n_dir * n_rep
    for k in range(1, n_task):
        ax.axvline(k * per_task - 0.5, color="black", linewidth=1.5)
    for k, t in enumerate(da.task.values):
        ax.text((k + 0.5) * per_task - 0.5, -0.6, str(t), ha="center", va="bottom", fontsize=8, fontweight="bold")
    ax.set_xticks(np.arange(len(cols) + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(n_sel + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=0.8)
    ax.tick_params(which="minor", length=0)
    counts = {c: int((vals == c).sum()) for c in CLASSES}
    ax.legend(handles=[Patch(facecolor=CLASS_COLOURS[c], edgecolor="grey", label=f"{c} ({counts[c]})")
                       for c in CLASSES], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "endpoint classes (B donor, C third, D recipient)", fontsize=10, pad=22)
    return png_bytes(fig)


# ----------------------------------------------------------------------------- K/V profile


def kv_profile(profiles: dict[str, xr.Dataset], title: str = "") -> bytes:
    """Per-layer K/V difference profile (relative L2 and max |d|) of one or more capture
    pairs; a pair with identical states is drawn flat at zero and named so."""
    if not profiles:
        return _message("no capture pair to compare")
    fig = _figure(9.0, 3.6)
    ax_l2, ax_max = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    styles = {"K": "-", "V": "--"}
    for k, (label, p) in enumerate(profiles.items()):
        colour = f"C{k % 10}"
        for comp in p.component.values:
            c = p.sel(component=comp)
            for ax, var in ((ax_l2, "l2_rel"), (ax_max, "max_abs")):
                ax.plot(p.layer.values, c[var].values, linestyle=styles.get(str(comp), ":"), marker=".",
                        color=colour, label=f"{label} {comp}")
    for ax, name in ((ax_l2, "L2 of the difference / L2 of the state"), (ax_max, "max |difference|")):
        ax.set_xlabel("layer")
        ax.set_ylabel(name, fontsize=9)
        ax.grid(alpha=0.3)
    ax_max.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.suptitle(title or "per-layer K/V differences", fontsize=10)
    return png_bytes(fig)


# ----------------------------------------------------------------------------- natural trajectories


def margin_trajectories(ds: xr.Dataset, title: str = "") -> bytes:
    """Top-1 margin (logit of the greedy token minus the runner-up) per output index along
    each natural arm's own trajectory, one panel per prompt; the first output index where
    the arms' tokens differ is marked."""
    tasks = [str(t) for t in ds.task.values]
    if not tasks:
        return _message("no natural trajectories")
    fig = _figure(9.0, 2.4 * len(tasks) + 0.6)
    for k, t in enumerate(tasks):
        ax = fig.add_subplot(len(tasks), 1, k + 1)
        cell = ds.sel(task=t)
        for j, arm in enumerate(cell.arm.values):
            m = cell["margin"].sel(arm=arm).values
            ok = np.isfinite(m)
            ax.plot(cell.output.values[ok], m[ok], marker=".", markersize=3, linewidth=1, color=f"C{j}",
                    label=str(arm))
        fd = int(cell["first_diff"])
        if fd >= 0:
            ax.axvline(fd, color="black", linestyle=":", linewidth=1)
            at = cell["margin"].sel(output=fd).values
            ax.annotate(f"first divergence at {fd}\nmargins " + ", ".join(f"{v:.3g}" for v in at if np.isfinite(v)),
                        xy=(fd, 0), xytext=(4, 4), textcoords="offset points", fontsize=7)
        else:
            ax.text(0.01, 0.95, "natural endpoints equal", transform=ax.transAxes, ha="left", va="top", fontsize=8)
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("top-1 margin", fontsize=8)
        ax.set_title(t, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_xlabel("output index")
    fig.suptitle(title or "natural arms: top-1 margin per output", fontsize=10)
    return png_bytes(fig)


# ----------------------------------------------------------------------------- frontier contrasts


def frontier_contrasts(rows: Sequence[dict], components: dict | None = None, title: str = "") -> bytes:
    """One line per panel repeat with a frontier: the four arms' fixed-pair scores at t*
    (EMPTY, C1, C2, BOTH) and the additive prediction; the gap between BOTH and the
    additive marker is the interaction I.  ``rows``: ``analysis.frontier.frontier_rows``;
    ``components``: panel -> its (C1, C2) selector names, shown in the row labels."""
    rows = [r for r in rows if r.get("t_star", -1) >= 0 and "scores" in r]
    if not rows:
        return _message("no panel has a frontier within the cap: no contrast to draw")
    fig = _figure(9.0, 0.42 * len(rows) + 1.6)
    ax = fig.add_subplot(1, 1, 1)
    y = np.arange(len(rows))[::-1]
    scores = np.array([r["scores"] for r in rows], dtype=float)
    additive = np.array([r["additive"] for r in rows], dtype=float)
    for k, (name, marker) in enumerate(zip(("EMPTY", "C1", "C2", "BOTH"), ("o", "s", "^", "D"))):
        ax.scatter(scores[:, k], y, marker=marker, color=f"C{k}", label=name, zorder=3, s=28)
    ax.scatter(additive, y, marker="|", color="black", s=160, label="additive prediction", zorder=4)
    ax.hlines(y, np.minimum(scores[:, 3], additive), np.maximum(scores[:, 3], additive), color="grey",
              linewidth=2, alpha=0.6, label="interaction I")
    ax.axvline(0, color="grey", linewidth=0.6)
    comps = components or {}
    ax.set_yticks(y, [f"{r['task']} {r['panel']}" + (" ({}/{})".format(*comps[r["panel"]]) if r["panel"] in comps
                                                      else "") + f" {r['direction']} r{r['repeat']}  t*={r['t_star']}"
                      for r in rows], fontsize=7)
    ax.set_xlabel("score at t* = logit(a) - logit(b)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title or "frontier contrasts", fontsize=10)
    return png_bytes(fig)


# ----------------------------------------------------------------------------- campaign forest


def forest(rows: Sequence[dict], threshold: float | None = None, title: str = "") -> bytes:
    """Forest plot of request-time ratios with their bootstrap intervals; ratios not compared
    (an arm not qualified against R) are listed with the reason instead of a point."""
    if not rows:
        return _message("no ratio in the campaign")
    fig = _figure(8.0, 0.5 * len(rows) + 1.4)
    ax = fig.add_subplot(1, 1, 1)
    y = np.arange(len(rows))[::-1]
    labels = []
    for yy, r in zip(y, rows):
        if r.get("qualified") and "estimate" in r:
            lo, est, hi = r["lower"], r["estimate"], r["upper"]
            colour = "#2b6cb0" if r.get("above_threshold") else "#4a5568"
            ax.hlines(yy, lo, hi, color=colour, linewidth=2)
            ax.plot([est], [yy], marker="s", color=colour, markersize=7)
            ax.annotate(f"{est:.3f} [{lo:.3f}, {hi:.3f}]", xy=(hi, yy), xytext=(8, 0), textcoords="offset points",
                        va="center", fontsize=7)
            labels.append(r["ratio"])
        else:
            labels.append(f"{r['ratio']} (not compared)")
    ax.axvline(1.0, color="black", linewidth=0.8)
    if threshold is not None:
        ax.axvline(threshold, color="#dd6b20", linestyle="--", linewidth=0.8, label=f"threshold {threshold:g}")
        ax.legend(fontsize=7, loc="lower right")
    from matplotlib.ticker import FormatStrFormatter

    ax.set_xscale("log")  # a ratio and its inverse sit symmetrically about 1
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("request-time ratio, log scale (95% percentile bootstrap over sessions)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or "speculative campaign: request-time ratios", fontsize=10)
    return png_bytes(fig)


# ----------------------------------------------------------------------------- findings


def class_overview(klass: xr.DataArray, title: str = "") -> bytes:
    """Compact heatmap of many cells: rows selectors, columns task x direction, one colour
    per class ('' blank), no letters (the findings studies have thousands of cells)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    da = klass.transpose("selector", "task", "direction")
    vals = da.values.astype(str)
    n_sel, n_task, n_dir = vals.shape
    flat = vals.reshape(n_sel, -1)
    codes = np.select([flat == c for c in CLASSES], range(1, len(CLASSES) + 1), 0)
    fig = _figure(max(5.0, 0.16 * flat.shape[1] + 2.5), max(3.0, 0.1 * n_sel + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    cmap = ListedColormap([CLASS_COLOURS[""]] + [CLASS_COLOURS[c] for c in CLASSES])
    ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(CLASSES) + 0.5, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(n_sel), [str(s) for s in da.selector.values], fontsize=5)
    ax.set_xticks([k * n_dir + (n_dir - 1) / 2 for k in range(n_task)], [str(t) for t in da.task.values],
                  rotation=70, ha="right", fontsize=6)
    for k in range(1, n_task):
        ax.axvline(k * n_dir - 0.5, color="black", linewidth=0.6)
    counts = {c: int((vals == c).sum()) for c in CLASSES}
    ax.legend(handles=[Patch(facecolor=CLASS_COLOURS[c], edgecolor="grey", label=f"{c} ({counts[c]})")
                       for c in CLASSES], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_xlabel("task (columns within a task: " + ", ".join(str(d) for d in da.direction.values) + ")", fontsize=8)
    ax.set_title(title or "endpoint classes", fontsize=10)
    return png_bytes(fig)


def histogram(values: Sequence[float], xlabel: str, title: str = "", bins: int = 30) -> bytes:
    """A histogram of finite values (a message figure when there are none)."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if x.size == 0:
        return _message(f"{title}: nothing to draw")
    fig = _figure(5.5, 3.2)
    ax = fig.add_subplot(1, 1, 1)
    ax.hist(x, bins=min(bins, max(1, np.unique(x).size)), color=CLASS_COLOURS["B"], edgecolor="white")
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel("count", fontsize=9)
    ax.set_title(title, fontsize=10)
    return png_bytes(fig)


def histograms(groups: Mapping[str, Sequence[float]], xlabel: str, title: str = "", bins: int = 30) -> bytes:
    """One histogram panel per group of finite values, side by side, each with its own count
    axis (a message figure when no group has a value)."""
    xs = {k: np.asarray([v for v in vs if v is not None and np.isfinite(v)], dtype=np.float64)
          for k, vs in groups.items()}
    if not any(x.size for x in xs.values()):
        return _message(f"{title}: nothing to draw")
    fig = _figure(3.2 * len(xs) + 0.6, 3.2)
    for i, (name, x) in enumerate(xs.items(), 1):
        ax = fig.add_subplot(1, len(xs), i)
        if x.size:
            ax.hist(x, bins=min(bins, max(1, np.unique(x).size)), color=CLASS_COLOURS["B"], edgecolor="white")
        else:
            ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel("count", fontsize=9)
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=10)
    return png_bytes(fig)
