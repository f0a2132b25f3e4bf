"""The base model of mds-sft / mds-dpo as the job reads it: a model directory's weights read tensor by tensor into
the model (never the whole state dict beside the model), and its tokenizer loaded without transformers taking the
project's config.json for its own."""
import logging

import torch

from finetune.lm.job.arguments import post_training_parser
from finetune.lm.job.providers import build_in_dtype, frozen_copy, provide_base, weights_dtype
from pipeline.checkpoints.model_dir import read_model_dir
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.safetensors_io import reports_shapes
from test_post_training_cli import write_chat_base


def test_the_base_is_read_into_the_model_tensor_by_tensor_and_its_tokenizer_without_a_warning(tmp_path, caplog):
    base_dir = write_chat_base(tmp_path / "base")
    args = post_training_parser("sft", "conversations")[0].parse_args(
        ["--base", str(base_dir), "--data", str(tmp_path / "none.jsonl")])
    with caplog.at_level(logging.WARNING):
        base = provide_base(args, None)
    assert not [r for r in caplog.records if "model of type" in r.getMessage()]  # "a model of type `gpt` ..."
    assert len(base.tokenizer) == base.config.vocab_size
    assert reports_shapes(base.state)  # lazy: each tensor read when the model asks for it
    model = base.family.build(base.config, 0)
    load_full_state_dict(model, base.state)
    _, eager, _ = read_model_dir(base_dir)
    assert all(torch.equal(p, eager[n]) for n, p in model.named_parameters())


def test_under_bf16_the_base_is_built_in_bf16_and_rounds_as_deepspeeds_cast(tmp_path):
    """The frozen base is never held in fp32 first: its weights are bf16 from the build, and the loaded values equal
    an fp32 model's cast to bf16 (what DeepSpeed's bf16 engine does to the module) bit for bit."""
    base_dir = write_chat_base(tmp_path / "base")
    args = post_training_parser("sft", "conversations")[0].parse_args(
        ["--base", str(base_dir), "--data", str(tmp_path / "none.jsonl")])
    base = provide_base(args, None)
    dtype = weights_dtype({"bf16": {"enabled": True}})
    model = build_in_dtype(base, base.config, 0, dtype)
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    load_full_state_dict(model, base.state)
    reference = base.family.build(base.config, 0)
    load_full_state_dict(reference, base.state)
    reference = reference.to(torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_the_frozen_dpo_reference_is_built_in_the_runs_dtype(tmp_path):
    """Full DPO's reference under bf16: built in bf16 (no fp32 copy of the base first), frozen, in eval mode, and
    equal to the fp32 base's cast."""
    base_dir = write_chat_base(tmp_path / "base")
    args = post_training_parser("dpo", "preferences")[0].parse_args(
        ["--base", str(base_dir), "--data", str(tmp_path / "none.jsonl")])
    base = provide_base(args, None)
    reference = frozen_copy(base, torch.bfloat16, "cpu")
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    full = base.family.build(base.config, 0)
    load_full_state_dict(full, base.state)
    assert all(torch.equal(p, q.to(torch.bfloat16))
               for p, q in zip(reference.parameters(), full.parameters(), strict=True))
