"""The E-c recipe's training step against the machine's limit and against Hugging Face, side by side in one run.

    python bench/finetune_speed.py [--base runs/smollm2-135m] [--rounds 12] [--out bench/results/finetune_speed.json]

Seven systems train SmolLM2-135M (imported once into --base, as bench/emotion_finetune.py does) on the real E-c
training tweets, one step of 16 tweets each in turn (the order rotating, bench/common.py's ``interleaved``):

- ``before``: the recipe as it ran until this benchmark existed: the DeepSpeed config's micro-batch (4, so 4
  micro-batches accumulated per step) on randomly drawn batches, each padded to its longest tweet;
- ``ZeRO-1, micro 16, random``: the whole batch in one micro-batch (``finetune.train`` now chooses it from the
  data);
- ``ZeRO-1, micro 16, grouped``: one micro-batch of tweets of similar length (``--group-by-length``);
- ``ZeRO-0, micro 16, grouped``: the same at ZeRO stage 0, which ``finetune.train`` runs on one data-parallel
  rank when no DeepSpeed config is given;
- ``after``: the same with torch's fused AdamW (``"fused": true`` in ds_configs/cpu.json's optimizer params:
  one pass over the fp32 master weights instead of a dozen element-wise kernels, 5x faster on this CPU): the
  recipe today. Every other engine system steps with the multi-tensor (``foreach``) AdamW the config had;
- ``HF``: ``transformers``' ``AutoModelForSequenceClassification`` of the same weights (the export's
  architecture) in a plain PyTorch loop (AdamW, bf16 autocast, SDPA attention with the padding mask) on the
  ``after`` system's batches, with torch's default AdamW (what a plain loop writes) and with the fused one,
  and with the fused one and transformers' eager attention (plain matrix products, faster than SDPA's CPU
  kernel at tweet lengths). "vs best HF" is against the faster of the two fused ones.

Model FLOP/s are counted over real (non-pad) tokens, 6 x the non-embedding parameters per token (the count of
Kaplan et al. and of the issue this answers), and compared with a bf16 2048^3 matrix product measured in the
same run (its best of before and after the steps). Prints a table; writes it as JSON.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import System, format_table, interleaved, machine_note, matmul_peak, median, quiet_deepspeed  # noqa: E402
from emotion_finetune import DATA, ensure_base  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

from finetune.batching import TrainBatches  # noqa: E402
from finetune.job.args import parse_args  # noqa: E402
from finetune.job.loop import finetune_step  # noqa: E402
from finetune.job.providers import provide_base, provide_data, provide_engine, provide_head, fit_ds_config  # noqa: E402
from finetune.recipes import EC_RECIPE  # noqa: E402
from pipeline.engine.ds_config import resolve_ds_config, zero_stage  # noqa: E402
from pipeline.hf.convert import to_hf  # noqa: E402
from pipeline.job.loop import setup  # noqa: E402
from pipeline.job.options import EngineOptions  # noqa: E402

BEFORE_MICRO = 4  # ds_configs/cpu.json's train_micro_batch_size_per_gpu, what the recipe ran with


def recipe_args(base: str, train: str, dev: str, config: str | None):
    return parse_args(["--base", base, "--train", train, "--dev", dev, "--hf-export", "no", *EC_RECIPE,
                       *(["--deepspeed_config", config] if config else [])])


def with_fused_adamw(job, fused: bool):
    """The job with its DeepSpeed config's torch AdamW fused or not (what ds_configs/cpu.json had before)."""
    ds = copy.deepcopy(job.ds)
    ds["optimizer"]["params"]["fused"] = fused
    return dataclasses.replace(job, ds=ds)


def engine_system(name, args, base, data, head, job, group_by_length: int) -> System:
    engine = provide_engine(args, dataclasses.replace(base, state=copy.copy(base.state)), data, head, job)[0]
    batches = TrainBatches(data.encoded["train"], data.train.labels, job.micro_batch, 0, 1, base.pad_id,
                           seed=args.seed, group_by_length=group_by_length, global_batch_size=job.global_batch)
    return System(name, lambda: finetune_step(engine, batches)["tokens"], owner=engine)


def hf_system(args, base, data, head, job, group_by_length: int, fused: bool, attention: str = "sdpa") -> System:
    """The same weights as transformers' sequence classifier, trained in a plain loop on the same batches;
    ``attention``: transformers' attn_implementation (sdpa, its default; eager: plain matrix products)."""
    cfg, sd = to_hf({k: v.float() for k, v in base.state.items()}, base.config)
    cfg.num_labels, cfg.pad_token_id, cfg.problem_type = data.train.num_labels, base.pad_id, "multi_label_classification"
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation=attention, dtype=torch.float32)
    model.load_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"}, strict=False)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=fused or None)
    batches = TrainBatches(data.encoded["train"], data.train.labels, job.global_batch, 0, 1, base.pad_id,
                           seed=args.seed, group_by_length=group_by_length, global_batch_size=job.global_batch)
    pos_weight = head.pos_weight

    def step() -> int:
        b = next(batches)
        mask = torch.arange(b["input_ids"].shape[1])[None, :] < b["lengths"][:, None]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=b["input_ids"], attention_mask=mask.long()).logits
        loss = F.binary_cross_entropy_with_logits(logits.float(), b["labels"], pos_weight=pos_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int(b["lengths"].sum())
    label = f"HF AutoModelForSequenceClassification, plain loop, {'fused' if fused else 'default'} AdamW"
    return System(label + ("" if attention == "sdpa" else f", {attention} attention"), step, owner=model)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=str(ROOT / "runs" / "smollm2-135m"))
    p.add_argument("--train", default=str(DATA / "train.tsv"))
    p.add_argument("--dev", default=str(DATA / "dev.tsv"))
    p.add_argument("--deepspeed-config", default=str(ROOT / "ds_configs" / "cpu.json"))
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "finetune_speed.json"))
    a = p.parse_args(argv)
    quiet_deepspeed()
    ensure_base(Path(a.base))
    args = recipe_args(a.base, a.train, a.dev, a.deepspeed_config)  # the config the recipe ran with before
    group = args.group_by_length
    base = provide_base(args)
    data = provide_data(args, base)
    head = provide_head(args, base, data)
    job = setup(EngineOptions.from_args(args))
    before = with_fused_adamw(dataclasses.replace(job, ds=resolve_ds_config(
        job.ds, data_parallel=1, micro_batch_size=BEFORE_MICRO, global_batch_size=job.global_batch)), False)
    zero1 = with_fused_adamw(fit_ds_config(args, base, data, job, torch.device("cpu")), False)  # as given: ZeRO-1
    after = fit_ds_config(recipe_args(a.base, a.train, a.dev, None), base, data, job, torch.device("cpu"))
    zero0 = with_fused_adamw(after, False)
    m = after.micro_batch
    systems = [engine_system(f"before: ZeRO-1, micro-batch {BEFORE_MICRO} x {job.global_batch // BEFORE_MICRO}, "
                             f"random", args, base, data, head, before, 0),
               engine_system(f"ZeRO-1, micro-batch {m}, random", args, base, data, head, zero1, 0),
               engine_system(f"ZeRO-1, micro-batch {m}, grouped by length ({group})", args, base, data, head,
                             zero1, group),
               engine_system(f"ZeRO-{zero_stage(after.ds)}, micro-batch {m}, grouped by length ({group})",
                             args, base, data, head, zero0, group),
               engine_system(f"after: ZeRO-{zero_stage(after.ds)}, micro-batch {m}, grouped, fused AdamW",
                             args, base, data, head, after, group),
               hf_system(args, base, data, head, job, group, fused=False),
               hf_system(args, base, data, head, job, group, fused=True, attention="eager"),
               hf_system(args, base, data, head, job, group, fused=True)]

    non_embedding = base.config.num_parameters() - base.config.vocab_size * base.config.hidden_size
    peak0 = matmul_peak(torch.bfloat16, n=2048, seconds=2.0)
    t0 = time.perf_counter()
    interleaved(systems, a.rounds, warmup=2, progress="finetune steps")
    seconds = time.perf_counter() - t0
    peak = max(peak0, matmul_peak(torch.bfloat16, n=2048, seconds=2.0))

    rows, out = [], {"machine": machine_note(), "peak_bf16_flops": peak, "rounds": a.rounds,
                     "non_embedding_params": non_embedding, "bench_seconds": seconds, "systems": {}}
    ref = systems[0]
    rate = {x.name: float(np.sum(x.results) / np.sum(x.times)) for x in systems}
    hf_default = systems[-3]
    hf = max(systems[-2:], key=lambda x: rate[x.name])  # the strongest baseline: fused AdamW, the faster attention
    for s in systems:
        tok_s = rate[s.name]
        flops = 6 * non_embedding * tok_s
        row = {"step_s": median(s.times), "real_tokens_per_s": tok_s, "model_flops": flops,
               "fraction_of_peak": flops / peak,
               "tokens_per_s_vs_before": tok_s / rate[ref.name],
               "tokens_per_s_vs_hf_default_adamw": tok_s / rate[hf_default.name],
               "tokens_per_s_vs_hf": tok_s / rate[hf.name]}
        out["systems"][s.name] = row
        rows.append([s.name, row["step_s"], tok_s, flops / 1e9, row["fraction_of_peak"],
                     row["tokens_per_s_vs_before"], row["tokens_per_s_vs_hf_default_adamw"], row["tokens_per_s_vs_hf"]])
    print(f"\nE-c recipe step (global batch {job.global_batch}, SmolLM2-135M, bf16); {machine_note()}; "
          f"bf16 matmul peak {peak / 1e9:.0f} GFLOP/s")
    out["strongest_hf"] = hf.name
    print(format_table(["system", "step s", "real tok/s", "GFLOP/s", "of peak", "vs before", "vs HF default",
                        "vs best HF"], rows))
    print(f"best HF: {hf.name}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
