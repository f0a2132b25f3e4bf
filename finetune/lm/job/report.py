"""The end of an SFT or DPO run: one summary line (steps, the last loss, tokens/s, where the exports are) and the
commands that use them, as the pretraining job ends (``pipeline.job.run_dir``); and the same command run again on
the finished run: its summary once more, nothing trained (as ``finetune.job.finish.finished_before``)."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from pipeline.job.files import OutputError
from pipeline.job.run_dir import changed_settings, next_lines, run_paths, summary_line

EXPORTS = ("adapter", "hf", "model")  # what a finished run leaves in --save (adapter/ with LoRA only)


@dataclass
class Trained:
    """What a run trained: the summary's numbers."""
    steps: int
    losses: list
    last: dict            # the last step's record
    finished: bool
    tokens: int = 0       # target tokens of this command's steps (the summary's tokens/s)
    seconds: float = 0.0


def summary(args, name: str, *, first: int, trained: Trained, exports: dict) -> list[str]:
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


def is_finished(save: Path) -> bool:
    return (save / "hf").is_dir() and (save / "model").is_dir()


def finished_before(args, name: str) -> tuple[list[str], dict] | None:
    """When --save holds the run this very command finished (its args.json, no setting changed): the lines that
    say so, its summary and the next commands, and the command's result (as a run's: steps, losses, the last
    record, the exports); None when there is none (the command runs, or ``check_save`` refuses the directory). A
    finished run of other settings is refused naming them."""
    save = Path(args.save) if args.save else None
    if save is None or args.force or args.no_resume or not is_finished(save):
        return None
    changed = changed_settings(save, args)
    if changed is None:
        return None
    if args.epochs is not None:  # --train-steps is what --epochs came to (args.json holds it), not a flag given
        changed = [c for c in changed if not c.startswith("--train-steps ")]
    if changed:
        raise OutputError(f"--save {save}: holds a finished run with other settings ({', '.join(changed)}); choose "
                          f"a new directory, or pass --force to train it again")
    logged = _records(save / "metrics.jsonl")
    steps = max((r["step"] for r in logged), default=0)
    trained = Trained(steps, [r["loss"] for r in logged], logged[-1] if logged else {}, True)
    exports = {k: str(save / k) for k in EXPORTS if (save / k).is_dir()}
    lines = [f"{save} holds the run this command finished at step {steps}: nothing to run (--force trains it again)",
             *summary(args, name, first=steps + 1, trained=trained, exports=exports)]
    return lines, {"steps": steps, "losses": trained.losses, **trained.last, **exports, "finished_before": True}


def _records(metrics: Path) -> list[dict]:
    """The logged steps of a run's metrics.jsonl (one series: a continued run dropped what it ran again)."""
    if not metrics.is_file():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines())
            if isinstance(r.get("step"), int) and r.get("loss") is not None]
