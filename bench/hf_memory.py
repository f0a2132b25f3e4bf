"""Peak resident memory of importing a Hugging Face model and exporting it back, against its safetensors size.

    python bench/hf_memory.py [--work DIR] [--layers 22] [--dtype bfloat16] [--code CHECKOUT ...]

Builds a random Llama of about 1.1B parameters (TinyLlama's shape: hidden 2048, 22 layers, 32 heads / 4 KV
heads, SwiGLU 5632, vocabulary 32000, untied) as a Hugging Face directory, then runs, each in a fresh process
whose peak RSS (``ru_maxrss``) is read when it ends:

* ``python -m pipeline.import_hf --model HF --out PROJECT --dtype D`` (Hugging Face -> the project's directory)
* ``python -m pipeline.export_hf --checkpoint PROJECT --out HF2 --dtype D`` (and back)
* ``python -c 'import pipeline.import_hf, pipeline.export_hf'``: what the interpreter and its libraries cost
  before any weight is read (torch, transformers, DeepSpeed).

``--code`` runs the same commands from other checkouts of the project (``PYTHONPATH``), e.g. an earlier commit
in a ``git worktree``, so that the figures before and after a change come from one run on one machine. The goal
(issue 14): peak <= 1.3x the safetensors size. Writes ``hf_memory.json`` to --work.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from models import GPT  # noqa: E402
from models.config import GPTConfig  # noqa: E402
from pipeline.hf.export import export_hf  # noqa: E402
from pipeline.hf.safetensors_io import PlannedTensor  # noqa: E402


def tinyllama_config(layers: int) -> GPTConfig:
    return GPTConfig(variant="llama", vocab_size=32000, hidden_size=2048, num_layers=layers, num_heads=32,
                     num_kv_heads=4, ffn_hidden_size=5632, seq_length=2048, max_position_embeddings=2048,
                     tie_embeddings=False, bias=False)


def random_hf_model(out: Path, layers: int, dtype: torch.dtype) -> int:
    """A random Hugging Face Llama at ``out`` (written one tensor at a time); returns its weights' bytes."""
    config = tinyllama_config(layers)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in GPT(config, init_seed=0).named_parameters()}

    def maker(shape, seed):
        def make():
            g = torch.Generator().manual_seed(seed)
            return (torch.randn(shape, generator=g) * 0.02).to(dtype)
        return make

    full = {name: PlannedTensor(shape, dtype, maker(shape, i)) for i, (name, shape) in enumerate(shapes.items())}
    export_hf(config, full, out, dtype=dtype, force=False)
    return weights_bytes(out)


def weights_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def peak_rss(cmd: list[str], code: Path) -> tuple[float, float]:
    """(peak RSS in bytes, seconds) of one command run from checkout ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} (from {code}) failed:\n{out[-3000:]}")
    return usage.ru_maxrss * 1024.0, time.perf_counter() - t


def measure(code: Path, hf_dir: Path, work: Path, dtype: str) -> dict:
    tag = code.name or "root"
    project, back = work / f"project-{tag}", work / f"hf-back-{tag}"
    py = sys.executable
    base, _ = peak_rss([py, "-c", "import pipeline.import_hf, pipeline.export_hf"], code)
    imp, t_imp = peak_rss([py, "-m", "pipeline.import_hf", "--model", str(hf_dir), "--out", str(project),
                           "--dtype", dtype, "--force"], code)
    exp, t_exp = peak_rss([py, "-m", "pipeline.export_hf", "--checkpoint", str(project), "--out", str(back),
                           "--dtype", dtype, "--force"], code)
    return {"code": str(code), "interpreter_bytes": base, "import_peak_bytes": imp, "import_seconds": t_imp,
            "export_peak_bytes": exp, "export_seconds": t_exp,
            "project_weights_bytes": weights_bytes(project), "export_weights_bytes": weights_bytes(back)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_hf_memory"))
    p.add_argument("--layers", type=int, default=22, help="22: about 1.1B parameters")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--code", nargs="*", default=[], help="other checkouts to measure beside this one")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = work / f"random-llama-{args.layers}l-{args.dtype}"
    if not hf_dir.is_dir():
        print(f"writing a random {args.layers}-layer Llama to {hf_dir} ...", flush=True)
        random_hf_model(hf_dir, args.layers, getattr(torch, args.dtype))
    size = weights_bytes(hf_dir)
    params = tinyllama_config(args.layers).num_parameters()
    print(f"model: {params / 1e9:.2f}B parameters, {size / 2**30:.2f} GiB of {args.dtype} safetensors", flush=True)
    rows = []
    for code in [ROOT, *map(Path, args.code)]:
        row = measure(code.resolve(), hf_dir, work, args.dtype)
        rows.append(row)
        print(f"{row['code']}: interpreter {row['interpreter_bytes'] / 2**30:.2f} GiB; import peak "
              f"{row['import_peak_bytes'] / 2**30:.2f} GiB = {row['import_peak_bytes'] / size:.2f}x "
              f"({row['import_seconds']:.0f} s); export peak {row['export_peak_bytes'] / 2**30:.2f} GiB = "
              f"{row['export_peak_bytes'] / size:.2f}x ({row['export_seconds']:.0f} s)", flush=True)
    result = {"benchmark": "hf_memory", "parameters": params, "dtype": args.dtype, "safetensors_bytes": size,
              "goal": "peak <= 1.3x the safetensors size", "load_average": os.getloadavg(), "runs": rows}
    (work / "hf_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
