"""The end of an SFT or DPO run: one summary line (steps, the last loss, tokens/s, where the exports are) and the
commands that use them, as the pretraining job ends (``pipeline.job.run_dir``)."""
from __future__ import annotations

import shlex
from pathlib import Path

from pipeline.job.run_dir import next_lines, run_paths, summary_line


def summary(args, name: str, *, first: int, trained, exports: dict) -> list[str]:
    """``done: steps F-L, train loss X, N tokens/s, exports in SAVE (hf/, model/[, adapter/])`` and the next
    commands (generate and evaluate from the Hugging Face export, plot the curves)."""
    results = [f"train loss {trained.losses[-1]:.4f}"] if trained.losses else []
    if trained.seconds > 0:
        results.append(f"{trained.tokens / trained.seconds:,.0f} target tokens/s")
    if args.save is None:
        return [summary_line(first, trained.steps, results, "nothing saved (no --save)")]
    save = Path(args.save)
    run, stem = run_paths(save)
    hf = shlex.quote(str(save / "hf"))
    where = f"exports in {save} ({', '.join(f'{k}/' for k in sorted(exports))})"
    return [summary_line(first, trained.steps, results, where),
            *next_lines([f"python -m pipeline.generate --hf {hf} --prompt 'Hello' --max-new-tokens 64",
                         f"python -m pipeline.evaluate --hf {hf} --task bpc --data TEXT_FILE --out {stem}-eval.json",
                         f"python -m pipeline.plot {run} --out {stem}-curves.png"])]
