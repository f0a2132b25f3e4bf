"""Training curves of one or several runs from their metrics.jsonl, overlaid (``python -m pipeline.plot``).

Panels against the optimizer step: training loss (solid) with validation loss (dashed, circles), learning
rate, and tokens/s, plus MFU when a run logged it, and for a mixture of experts (``models.moe``'s records) the
max/mean expert load and the dropped fraction of every MoE layer (one thin line per layer) and the auxiliary
loss. A run is a run directory or its metrics.jsonl.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.job.errors import UserError
from pipeline.job.files import atomic_write_figure


class PlotError(UserError):
    pass


def metrics_path(run: str | Path) -> Path:
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise PlotError(f"{run}: no metrics.jsonl; pass a run directory written with --save, or its metrics.jsonl")
    return path


def read_series(run: str | Path) -> dict[str, list[tuple[int, float]]]:
    """field -> [(step, value)] for every number logged with a step (a resumed run appends: the last value
    written for a step wins)."""
    path = metrics_path(run)
    series: dict[str, dict[int, float]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise PlotError(f"{path}:{lineno}: not a JSON record; is this a metrics.jsonl?") from None
        step = record.get("step")
        if not isinstance(step, int):
            continue
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, {})[step] = float(value)
    return {key: sorted(points.items()) for key, points in series.items()}


PANELS = (("loss", ("loss", "valid_loss", "dev_loss")), ("learning rate", ("lr",)), ("tokens/s", ("tokens_per_s",)),
          ("MFU", ("mfu",)), ("MoE load max/mean", ("moe_load_ratio_*",)),
          ("MoE dropped fraction", ("moe_dropped_fraction_*",)), ("MoE aux loss", ("moe_aux_loss",)))


def _panel_keys(run: dict, keys: tuple[str, ...]) -> list[str]:
    """The run's fields a panel draws: a key ending in ``*`` is one field per MoE layer (``moe_load_ratio_0``,
    ``_1``, ...), in layer order."""
    out = []
    for key in keys:
        if key.endswith("*"):
            layers = [k for k in run if k.startswith(key[:-1]) and k[len(key) - 1:].isdigit()]
            out += sorted(layers, key=lambda k: int(k[len(key) - 1:]))
        elif key in run:
            out.append(key)
    return out


def curves_figure(runs: list[dict], labels: list[str]):
    # matplotlib only when a chart is drawn
    from matplotlib.figure import Figure  # noqa: PLC0415
    panels = [p for p in PANELS if any(_panel_keys(run, p[1]) for run in runs)]
    if not panels:
        raise PlotError("no run logged loss, lr, tokens_per_s, mfu or MoE loads with a step")
    fig = Figure(figsize=(4.2 * len(panels), 3.2))
    for ax, (title, keys) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for i, (run, label) in enumerate(zip(runs, labels)):
            color = f"C{i % 10}"
            per_layer = keys[0].endswith("*")
            for j, key in enumerate(_panel_keys(run, keys)):
                steps, values = zip(*run[key])
                valid = key.startswith("valid")
                name = f"{label} ({'valid' if valid else 'train'})" if len(keys) > 1 else label
                ax.plot(steps, values, color=color, linestyle="--" if valid else "-", marker="o" if valid else None,
                        markersize=3, linewidth=0.8 if per_layer else 1.5,
                        label=f"{label}, layer {key.rsplit('_', 1)[1]}" if per_layer else name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_runs(runs: list[str | Path], out: str | Path, labels: list[str] | None = None, dpi: int = 80) -> Path:
    if labels and len(labels) != len(runs):
        raise PlotError(f"{len(labels)} --label for {len(runs)} runs; give one per run or none")
    labels = labels or [Path(r).name if Path(r).is_dir() else Path(r).parent.name for r in runs]
    return atomic_write_figure(out, curves_figure([read_series(r) for r in runs], labels), dpi)
