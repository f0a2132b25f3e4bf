"""The run directory's ``zero_to_fp32.py``: DeepSpeed copies its own into every run at each save, and it merges
one data-parallel group's ZeRO files only (at TP 2 it fails: "Expected 1 of '*_optim_states.pt' ... but found 2
files"; a pipeline's layer files it does not read). The project's replaces it at each save's commit
(``checkpoint.commit_tag``), its command in ``pipeline.checkpoints.full_weights``: the same name and arguments
(``python RUN/zero_to_fp32.py RUN OUT [-t TAG]``), the full weights of any layout through ``read_full_checkpoint``,
written as a project model directory (config.json + model.safetensors + tokenizer), which ``pipeline.generate``,
``pipeline.evaluate`` and ``pipeline.export_hf`` read. The weights are those the run computes with (a bf16 run's
in bf16; DeepSpeed's script gave the fp32 master copies of the optimizer)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from pipeline.job.errors import is_rank0
from pipeline.job.files import atomic_write_text

SCRIPT_NAME = "zero_to_fp32.py"
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout that wrote the run: the script reads with it
SCRIPT = '''#!/usr/bin/env python
"""The full weights of this run at any layout (TP, PP, ZeRO), written by the project that trained it over
DeepSpeed's zero_to_fp32.py (which merges one data-parallel group only):

    python zero_to_fp32.py RUN_DIR OUT_DIR [-t global_stepN]

OUT_DIR: config.json + model.safetensors + tokenizer, a project model directory; for Hugging Face,
python -m pipeline.export_hf --checkpoint RUN_DIR --out HF_DIR."""
import os
import sys

if os.path.isdir(os.path.join({root!r}, "pipeline")):
    sys.path.insert(0, {root!r})  # the checkout that wrote this run reads it (else the installed project)
try:
    from pipeline.checkpoints.full_weights import main
except ImportError as e:
    print(f"error: {{e}}: this run was written by the pipeline project; install it (pip install -e <checkout>) and "
          f"run this script again, or python -m pipeline.export_hf --checkpoint RUN_DIR --out HF_DIR", file=sys.stderr)
    sys.exit(2)
sys.exit(main(sys.argv[1:]))
'''


def script_text() -> str:
    """The run's zero_to_fp32.py, naming this checkout as the fallback place of the project."""
    return SCRIPT.format(root=str(PROJECT_ROOT))


def install(run_dir: Path) -> None:
    """Replace (rank 0) the zero_to_fp32.py DeepSpeed copied into ``run_dir`` at a save by the project's,
    executable (``checkpoint.commit_tag``, before ``latest`` moves)."""
    if not is_rank0():
        return
    script, text = Path(run_dir) / SCRIPT_NAME, script_text()
    if script.is_file() and script.read_text() == text:
        return
    atomic_write_text(script, text)
    os.chmod(script, script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
