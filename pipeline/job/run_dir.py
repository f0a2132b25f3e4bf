"""One run per directory: the same command again resumes the directory's run, its settings are saved beside its
checkpoints, and the end of the run says what it did and what to run next (docs/runs.md). The pretraining job
uses all of it (``start_run``, ``RunReport``); the finetuning job (``finetune.job``), whose run directory is a
classifier, its settings, its log and its summary.

    --save DIR                 resumed from DIR's last complete checkpoint when DIR holds one (no --load needed)
    --save DIR --no-resume     a new run: DIR must be new or empty
    DIR/args.json              the resolved arguments of the latest command that wrote the run
    DIR/ds_config.json         the resolved DeepSpeed config
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

from pipeline.checkpoints import checkpoint
from pipeline.job.errors import is_rank0
from pipeline.job.files import OutputError, atomic_write_text
from pipeline.tracking.metrics import MetricsWriter

ARGS_FILE = "args.json"
DS_CONFIG_FILE = "ds_config.json"
# what may differ between two commands of one run without changing the run
NOT_SETTINGS = {"load", "load_tag", "save", "no_resume", "force", "debug", "local_rank", "verbose", "config_file"}


def say(line: str) -> None:
    if is_rank0():
        print(line, flush=True)


def start_run(args: argparse.Namespace, inputs, command: str) -> None:
    """Before any work: --save resumed when it holds a complete checkpoint and no --load is given (sets
    ``args.load``), --no-resume refused on a non-empty --save, what the user owns protected
    (``checkpoint.check_save_dir``), the resume or a missing --save said in one line."""
    line = _auto_resume(args)
    checkpoint.check_save_dir(args.save, load=args.load, inputs=inputs)
    if line:
        say(line)
    if args.load is not None:
        report_changed_settings(Path(args.load), args)
    warn_without_save(args, command, "no checkpoint, no metrics.jsonl")


def warn_without_save(args: argparse.Namespace, command: str, kept: str) -> None:
    if args.save is None:
        say(f"warning: no --save: this run keeps nothing ({kept}); pass --save DIR to keep it ({command})")


def _auto_resume(args: argparse.Namespace) -> str | None:
    save = Path(args.save) if args.save else None
    if save is None or not save.is_dir():
        return None
    if getattr(args, "no_resume", False):
        refuse_non_empty(save)
        return None
    tags = checkpoint.complete_tags(save)
    if args.load is not None or not tags:
        return None
    args.load = str(save)
    latest = save / "latest"
    tag = args.load_tag or (latest.read_text(errors="replace").strip() if latest.is_file() else tags[-1])
    return f"resuming {save} from {tag}, its last complete checkpoint (--no-resume with a new --save starts over)"


def refuse_non_empty(save: Path) -> None:
    """--no-resume: a new run, in a new or empty directory only (hidden files such as a crashed run's lock aside)."""
    entries = sorted(n for n in os.listdir(save) if not n.startswith(".")) if save.is_dir() else []
    if entries:
        names = ", ".join(entries[:4]) + (" ..." if len(entries) > 4 else "")
        raise OutputError(f"--save {save} holds {names}; --no-resume starts a new run in a new or empty "
                          f"directory only: choose another --save (or drop --no-resume to resume it)")


def arguments_record(args: argparse.Namespace) -> dict:
    """The resolved arguments as JSON values."""
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in sorted(vars(args).items())}


def report_changed_settings(load_dir: Path | None, args: argparse.Namespace) -> list[str]:
    """On a resume: one line naming each setting that differs from the run's saved args.json (printed on rank 0)."""
    changed = changed_settings(load_dir, args) or []
    if changed:
        say(f"settings changed since {load_dir / ARGS_FILE}: " + ", ".join(changed))
    return changed


def changed_settings(run_dir: Path | None, args: argparse.Namespace) -> list[str] | None:
    """``--flag saved -> now`` for each setting that differs from the run's saved args.json (None without one)."""
    saved_file = run_dir / ARGS_FILE if run_dir is not None else None
    if saved_file is None or not saved_file.is_file():
        return None
    try:
        saved = json.loads(saved_file.read_text())
    except ValueError:
        return None
    now = json.loads(json.dumps(arguments_record(args), default=str))  # as args.json holds it
    return [f"--{k.replace('_', '-')} {_show(saved.get(k))} -> {_show(now.get(k))}"
            for k in sorted(set(saved) | set(now)) if k not in NOT_SETTINGS and saved.get(k) != now.get(k)]


def _show(value) -> str:
    return "(unset)" if value is None else ",".join(map(str, value)) if isinstance(value, list) else str(value)


def save_settings(save_dir: Path, args: argparse.Namespace, ds: dict) -> None:
    """args.json and ds_config.json in the run directory (rank 0; atomic)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(save_dir / ARGS_FILE, json.dumps(arguments_record(args), indent=2, default=str) + "\n")
    atomic_write_text(save_dir / DS_CONFIG_FILE, json.dumps(ds, indent=2, default=str) + "\n")


def settings_record(args: argparse.Namespace, ds: dict) -> dict:
    """Flat ``args/<flag>`` and ``ds/<dotted key>`` entries: what W&B's config and TensorBoard's hparams show."""
    flat = {f"args/{k}": v for k, v in arguments_record(args).items() if v is not None}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"ds/{prefix}{k}"] = v
    walk(ds, "")
    return flat


class RunReport:
    """What the run directory and the terminal are told: args.json and ds_config.json, metrics.jsonl (one series
    from ``start_step``), the settings to the monitors, validation losses, and the summary at the end."""

    def __init__(self, args: argparse.Namespace, ds: dict, monitor, *, start_step: int, prefix: str):
        self.save_dir = Path(args.save) if args.save else None
        rank0 = is_rank0()
        if self.save_dir is not None and rank0:
            save_settings(self.save_dir, args, ds)
        self.metrics = MetricsWriter(self.save_dir / "metrics.jsonl" if self.save_dir and rank0 else None,
                                     monitor=monitor, prefix=prefix, start_step=start_step)
        self.metrics.log_settings(settings_record(args, ds))
        self.first, self.steps, self.seconds, self.valid_loss = start_step + 1, 0, 0.0, None

    def step(self, r) -> None:
        """A hook on every step: the seconds of the summary's tokens/s."""
        self.steps += 1
        self.seconds += r.seconds

    def validation(self, r, record: dict) -> None:
        self.metrics.write(record)
        self.valid_loss = record["valid_loss"]
        extra = "".join(f", {k.removeprefix('valid_')} {v:.4g}" for k, v in record.items()
                        if k.startswith("valid_") and k != "valid_loss")
        if is_rank0():
            r.bar.write(f"step {r.step}: validation loss {self.valid_loss:.4f}{extra}")

    def finish(self, last_step: int, record: dict, tokens_per_step: int) -> None:
        tokens_per_s = self.steps * tokens_per_step / self.seconds if self.seconds > 0 else None
        self.end(summary_lines(self.save_dir, first=self.first, last=last_step, record=record,
                               valid_loss=self.valid_loss, tokens_per_s=tokens_per_s))

    def end(self, lines: list[str]) -> None:
        """metrics.jsonl closed, then the summary said (rank 0)."""
        self.metrics.close()
        for line in lines:
            say(line)


def summary_line(first: int, last: int, results: list[str], where: str) -> str:
    """``done: steps F-L, <results>, <where the result is>`` (``no steps to run`` when the run had ended)."""
    done = f"done: steps {first}-{last}" if first <= last else f"done: no steps to run (at step {last})"
    return ", ".join([done, *results, where])


def next_lines(commands: list[str]) -> list[str]:
    return ["next:", *(f"  {c}" for c in commands)] if commands else []


def run_paths(save_dir: Path) -> tuple[str, str]:
    """The run directory and the stem of the files beside it, quoted for a shell."""
    return shlex.quote(str(save_dir)), shlex.quote(str(save_dir).rstrip("/"))


def summary_lines(save_dir: Path | None, *, first: int, last: int, record: dict, valid_loss: float | None,
                  tokens_per_s: float | None) -> list[str]:
    """The pretraining run's one summary line and the commands that continue from its checkpoint."""
    results = [] if record.get("loss") is None else [f"train loss {record['loss']:.4f}"]
    if valid_loss is not None:
        results.append(f"validation loss {valid_loss:.4f}")
    if tokens_per_s:
        results.append(f"{tokens_per_s:,.0f} tokens/s")
    latest = save_dir / "latest" if save_dir is not None else None
    if latest is None or not latest.is_file():
        where = "no checkpoint saved (no --save)" if save_dir is None else f"no checkpoint in {save_dir}"
        return [summary_line(first, last, results, where)]
    run, stem = run_paths(save_dir)
    return [summary_line(first, last, results, f"last checkpoint {save_dir / latest.read_text().strip()}"),
            *next_lines([f"python -m pipeline.export_hf --checkpoint {run} --out {stem}-hf",
                         f"python -m pipeline.generate --checkpoint {run} --prompt 'Once upon a time' "
                         f"--out {stem}-samples.jsonl",
                         f"python -m pipeline.evaluate --checkpoint {run} --task bpc --data TEXT_FILE "
                         f"--out {stem}-eval.json",
                         f"python -m pipeline.plot {run} --out {stem}-curves.png"])]
