"""Figures for `fcp compare --plot` and the results page. matplotlib is an optional extra (`pip install fcp[plot]`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from fcp_compiler.errors import InvalidInputError

PLOT_FORMATS = ("png", "pdf", "svg")

# (row key, panel title) of the four panels of a comparison figure, in the seed's figures 9 and 11.
COMPARE_PANELS = (("compute_imbalance", "compute imbalance"), ("comm_imbalance", "communication imbalance"),
                  ("normalized_mfu_fwd", "normalized MFU, forward"), ("normalized_mfu_bwd", "normalized MFU, backward"))


def check_plot_path(path: str | Path) -> Path:
    """The path, once its format is known and matplotlib is importable.

    Raises:
        InvalidInputError: for a suffix other than .png/.pdf/.svg, or when matplotlib is not installed.
    """
    path = Path(path)
    if path.suffix.lstrip(".").lower() not in PLOT_FORMATS:
        raise InvalidInputError(f"--plot {str(path)!r}: the name must end in one of "
                                f"{', '.join('.' + f for f in PLOT_FORMATS)}")
    _pyplot()
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidInputError("plots need matplotlib: pip install 'fcp[plot]' (or matplotlib)") from None
    return plt


def _save(fig, path: Path) -> None:
    # Temporary name, then rename: an interrupted save leaves no half-written figure. Like every output of fcp,
    # the folder is made if it is missing.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InvalidInputError(f"cannot write {str(path)!r}: {error.strerror}") from None
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(temporary, dpi=110, format=path.suffix.lstrip(".").lower())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _draw(ax, series: dict[str, tuple[Sequence[float], Sequence[float]]], title: str, xlabel: str, ylabel: str,
          log_x: bool) -> None:
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def line_plot(path: str | Path, title: str, ylabel: str, series: dict[str, tuple[Sequence[float], Sequence[float]]],
              xlabel: str = "GPUs", log_x: bool = True) -> None:
    """One panel of lines, a (xs, ys) pair per name, written to path (format from its suffix).

    Raises:
        InvalidInputError: when matplotlib is not installed.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    try:
        _draw(ax, series, title, xlabel, ylabel, log_x)
        fig.tight_layout()
        _save(fig, Path(path))
    finally:
        plt.close(fig)


def sweep_figure(rows: Sequence[dict], path: str | Path, title: str) -> None:
    """The `fcp sweep` figure: normalized MFU, forward and backward, against block size.

    Raises:
        InvalidInputError: when matplotlib is not installed.
    """
    sizes = [row["block_size"] for row in rows]
    line_plot(path, title, "normalized MFU",
              {name: (sizes, [row[f"normalized_mfu_{key}"] for row in rows])
               for name, key in (("forward", "fwd"), ("backward", "bwd"))}, xlabel="block size")


def series_by_method(rows: Sequence[dict], key: str) -> dict[str, tuple[list, list]]:
    """{method: (gpus, values of key)} over the rows that have a value (methods that could not plan are left out)."""
    out: dict[str, tuple[list, list]] = {}
    for row in rows:
        if row.get(key) is not None:
            xs, ys = out.setdefault(row["method"], ([], []))
            xs.append(row["gpus"])
            ys.append(row[key])
    return out


def compare_figure(rows: Sequence[dict], path: str | Path, title: str) -> None:
    """The `fcp compare` figure: imbalance (compute, communication) and normalized MFU (forward, backward) against
    GPUs, a line per method.

    Raises:
        InvalidInputError: when matplotlib is not installed.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.4))
    try:
        for ax, (key, panel) in zip(axes.ravel(), COMPARE_PANELS):
            _draw(ax, series_by_method(rows, key), panel, "GPUs",
                  "imbalance" if "imbalance" in key else "normalized MFU", log_x=len({row["gpus"] for row in rows}) > 1)
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        _save(fig, Path(path))
    finally:
        plt.close(fig)
