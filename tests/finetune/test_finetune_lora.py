"""``finetune.train --lora`` as a user runs it: adapters on the encoder's linears and the head train, nothing else;
the classifier is saved (and exported to Hugging Face) with the adapters merged, and the PEFT adapter, loaded by
PEFT on the base's Hugging Face export, gives the saved encoder's hidden states; at TP2 the same."""
import json
import sys
from pathlib import Path

import pytest
import torch
from cli import run_cli
from conftest import ROOT, shared_data
from peft import PeftModel
from test_finetune_train import FP32_DS, ec_slice, write_base
from transformers import AutoModelForCausalLM

from finetune.job.args import parse_args
from finetune.model import build_classifier
from finetune.saved import load_full_gpt_state, read_classifier_dir
from models import GPT
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.engine.distributed import free_port
from pipeline.hf.export import export_hf
from pipeline.job.errors import UserError

BIN = Path(sys.executable).parent


def test_lora_trains_adapters_and_head_only_and_exports_both_the_same_at_tp2(tmp_path):
    ec = shared_data("semeval2018-ec")
    base = write_base(tmp_path / "base")
    (tmp_path / "ds.json").write_text(json.dumps(FP32_DS))
    save, tp2 = tmp_path / "run", tmp_path / "tp2"
    args = ["--base", base, "--train", ec_slice(ec / "train.tsv", tmp_path / "train.tsv", 64),
            "--dev", ec_slice(ec / "dev.tsv", tmp_path / "dev.tsv", 32), "--deepspeed_config", tmp_path / "ds.json",
            "--global-batch-size", 16, "--train-steps", 3, "--lr", 1e-2, "--max-length", 24, "--lora", "--lora-r", 4,
            "--lora-target-modules", "c_attn", "c_proj", "--log-interval", 1]
    run_cli([sys.executable, "-m", "finetune.train", *args, "--save", save], tmp_path)
    run_cli([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), ROOT / "finetune" / "train.py",
             *args, "--tensor-parallel", 2, "--hf-export", "no", "--save", tp2], tmp_path)
    _same_at_tp2(save, tp2)

    info, trained = read_classifier_dir(save)
    config, base_sd, _ = load_full_gpt_state(base)
    assert info["training"]["lora"]["target_modules"][:2] == ["transformer.h.0.attn.c_attn",
                                                              "transformer.h.0.attn.c_proj"]
    assert not any(".lora." in k for k in trained) and (save / "hf" / "config.json").is_file()  # merged, exported
    for name in ("embedding.word_embeddings.weight", "layers.0.mlp.fc_in.weight", "layers.1.input_norm.weight"):
        assert torch.equal(trained[f"encoder.{name}"], base_sd[name]), name  # not a target: frozen
    for name in ("layers.0.attention.qkv.weight", "layers.1.mlp.fc_out.weight"):
        assert not torch.allclose(trained[f"encoder.{name}"], base_sd[name]), name  # adapted, merged
    head = build_classifier(config, info["head_config"], encoder_state=base_sd).head
    assert not torch.allclose(trained["head.output.weight"], head.output.weight)  # the head trains in full

    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    base_hf = AutoModelForCausalLM.from_pretrained(export_hf(config, base_sd, tmp_path / "base_hf", tokenizer_dir=base))
    adapted = PeftModel.from_pretrained(base_hf, save / "adapter").eval()(ids, output_hidden_states=True)
    merged = GPT(config).eval()
    load_full_state_dict(merged, {k.removeprefix("encoder."): v for k, v in trained.items() if k.startswith("encoder.")})
    want = merged.hidden_states(ids)
    diff = ((adapted.hidden_states[-1] - want).abs().max() / want.abs().max()).item()
    print(f"PEFT adapter on the base's HF export vs the saved classifier's merged encoder: hidden states within "
          f"{diff:.1e}")
    assert diff < 2e-6  # measured 2.2e-7 (fp32)


def _losses(save):
    return [r["loss"] for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _same_at_tp2(tp1, tp2):
    """TP2's losses and merged classifier (its adapters cut as its linears are) equal TP1's."""
    first, second = _losses(tp1), _losses(tp2)
    losses = max(abs(a - b) / abs(a) for a, b in zip(first, second))
    one, two = read_classifier_dir(tp1)[1], read_classifier_dir(tp2)[1]
    weights, worst = max((((one[k] - two[k]).abs().max() / one[k].abs().max()).item(), k) for k in one)
    print(f"finetune.train --lora at TP2 vs TP1: losses {first} within {losses:.1e}, merged weights {weights:.1e} "
          f"(relative; {worst})")
    assert len(first) == len(second) == 3 and one.keys() == two.keys()
    # measured: losses 6.8e-8; weights 2.6e-5 (Adam's first steps divide each gradient by its own size, so
    # rounding-level gradient differences move a weight by up to ~lr where its gradient is near zero)
    assert losses < 1e-6 and weights < 2e-4


def test_lora_and_a_frozen_encoder_are_refused_by_the_parser():
    with pytest.raises(UserError, match="--lora trains adapters on the encoder: it cannot be combined with "
                                        "--freeze-encoder"):
        parse_args(["--base", "b", "--train", "t", "--dev", "d", "--lora", "--freeze-encoder"])
