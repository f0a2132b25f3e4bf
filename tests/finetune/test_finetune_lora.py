"""``finetune.train --lora`` as a user runs it: adapters on the encoder's linears and the head train, nothing else;
the classifier is saved (and exported to Hugging Face) with the adapters merged, and the PEFT adapter, loaded by
PEFT on the base's Hugging Face export, gives the saved encoder's hidden states."""
import json
import sys

import pytest
import torch
from cli import run_cli
from conftest import shared_data
from peft import PeftModel
from test_finetune_train import FP32_DS, ec_slice, write_base
from transformers import AutoModelForCausalLM

from finetune.job.args import parse_args
from finetune.model import build_classifier
from finetune.saved import load_full_gpt_state, read_classifier_dir
from models import GPT
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.export import export_hf
from pipeline.job.errors import UserError


def test_lora_trains_adapters_and_head_only_and_exports_both(tmp_path):
    ec = shared_data("semeval2018-ec")
    base = write_base(tmp_path / "base")
    (tmp_path / "ds.json").write_text(json.dumps(FP32_DS))
    save = tmp_path / "run"
    run_cli([sys.executable, "-m", "finetune.train", "--base", base, "--train", ec_slice(ec / "train.tsv",
             tmp_path / "train.tsv", 64), "--dev", ec_slice(ec / "dev.tsv", tmp_path / "dev.tsv", 32),
             "--deepspeed_config", tmp_path / "ds.json", "--global-batch-size", 16, "--train-steps", 3, "--lr", 1e-2,
             "--max-length", 24, "--lora", "--lora-r", 4, "--lora-target-modules", "c_attn", "c_proj",
             "--save", save], tmp_path)

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


def test_lora_and_a_frozen_encoder_are_refused_by_the_parser():
    with pytest.raises(UserError, match="--lora trains adapters on the encoder: it cannot be combined with "
                                        "--freeze-encoder"):
        parse_args(["--base", "b", "--train", "t", "--dev", "d", "--lora", "--freeze-encoder"])
