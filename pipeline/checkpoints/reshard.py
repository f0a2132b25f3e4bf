"""A checkpoint converted once, offline, into a run directory that resumes at any layout with its optimizer
state (``python -m pipeline.reshard``). The output holds the run's config and tokenizer, the universal checkpoint
(``universal/<tag>``, DeepSpeed's format) and a tag directory with the saved layout, data position and RNG
streams, marked as universal only; the source is not written to.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.checkpoints import checkpoint, universal
from pipeline.job.files import atomic_dir, refuse_overlap


def reshard(run_dir, out, tag: str | None = None, *, force: bool = False) -> Path:
    run_dir = Path(run_dir)
    refuse_overlap(out, [("--checkpoint", run_dir)])
    # sizes, sha256 and a scan of every file, before any is read
    tag = checkpoint.resolve_tag(run_dir, tag, choose="with --tag", flag="--tag")
    saved = checkpoint.saved_layout(run_dir, tag)
    reason = universal.unsupported_reason(saved, {"zero_stage": 1})
    if reason is not None:
        raise universal.UniversalError(f"{run_dir / tag} cannot be converted: {reason}")
    with atomic_dir(out, force=force) as tmp:
        shutil.copy2(run_dir / "config.json", tmp / "config.json")
        if (run_dir / "tokenizer").is_dir():
            shutil.copytree(run_dir / "tokenizer", tmp / "tokenizer")
        universal.ensure_cache(run_dir, tag, cache_root=tmp, log=lambda *_: None)
        tag_dir = tmp / tag
        tag_dir.mkdir()
        for state in sorted((run_dir / tag).glob("rank*_state.pt")):
            shutil.copy2(state, tag_dir / state.name)
        (tag_dir / "layout.json").write_text(json.dumps({**saved, "universal_only": True}, indent=2) + "\n")
        checkpoint.write_complete(tag_dir, saved["step"])
        (tmp / "latest").write_text(tag + "\n")
    return Path(out)
