"""Many command lines for the price of one Python start: the commands' modules are imported once, then each line
runs in a forked child exactly as ``python -m MODULE ARGS`` runs it (the module's ``__main__`` block, through
runpy), with its own stdout, stderr and exit code. The CLI tables of bad input use it: a fresh interpreter per
case costs seconds of imports (torch, DeepSpeed, transformers), a fork a fraction of one.

    results = run_forked([("pipeline.plan", ["--gpus", "0"]), ...], cwd)   # [(exit code, stdout, stderr)]
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback

from cli import run_cli


# the work each command imports once its arguments are parsed (its modules load no torch, for a fast --help): loaded
# here before the forks too, or every child would pay for the imports
WORK = {"pipeline.pretrain": "pipeline.pretraining", "pipeline.export_hf": "pipeline.hf.run",
        "pipeline.import_hf": "pipeline.hf.run", "pipeline.evaluate": "pipeline.evaluation.run",
        "pipeline.sentiment_neuron": "pipeline.evaluation.run", "pipeline.generate": "pipeline.generation.run",
        "pipeline.reshard": "pipeline.checkpoints.reshard", "pipeline.plan": "pipeline.planning.run",
        "finetune.train": "finetune.job.run", "finetune.predict": "finetune.scoring.classify",
        "finetune.export_hf": "finetune.hf_export", "finetune.ensemble.build": "finetune.ensemble.assemble",
        "finetune.ensemble": "finetune.ensemble.assemble", "finetune.lm.job.sft": "finetune.lm.job.jobs",
        "finetune.lm.job.dpo": "finetune.lm.job.jobs"}


def run_forked(cases, cwd, *, timeout: float = 120, env: dict | None = None) -> list[tuple[int, str, str]]:
    """Each (module, argv) case's (exit code, stdout, stderr); a case running past ``timeout`` is killed (-9)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"cases": [[m, [str(a) for a in argv]] for m, argv in cases], "timeout": timeout}, f)
    try:
        proc = run_cli([sys.executable, __file__, f.name], cwd, env=env, timeout=timeout * len(cases) + 120)
        return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]
    finally:
        os.unlink(f.name)


def _run_one(module: str, argv: list[str], timeout: float) -> tuple[int, str, str]:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:  # the child: a command line
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = 0
            try:
                sys.argv = [module, *argv]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = -9 & 0xFFFF
                break
            time.sleep(0.05)
        code = os.waitstatus_to_exitcode(status) if done else -9
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def _main(spec_file: str) -> None:
    spec = json.load(open(spec_file))
    for module in dict.fromkeys(m for m, _ in spec["cases"]):
        importlib.import_module(module)  # once, before the forks
        if module in WORK:
            importlib.import_module(WORK[module])
    results = [_run_one(m, argv, spec["timeout"]) for m, argv in spec["cases"]]
    sys.stdout.flush()
    print(json.dumps(results))


if __name__ == "__main__":
    _main(sys.argv[1])
