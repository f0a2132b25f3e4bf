"""Samples during pretraining at TP 2 (dropout on): the losses equal those of the run without samples, samples.jsonl
holds greedy and seeded samples at every N-th step, TensorBoard gets them as text, and the last step's samples
equal what ``pipeline.generate`` decodes from the saved run at TP 1."""
import json
from types import SimpleNamespace

import pytest
from dist import run_distributed
from run_utils import ds_config, pretrain_worker, write_corpus
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from models.parallel import destroy_model_parallel
from pipeline.generation.decode import generate
from pipeline.generation.decoders import decoder_for
from pipeline.generation.loading import load_generation_model
from pipeline.generation.prompts import PromptError
from pipeline.generation.sampling import SampleSettings
from models.parallel import Layout
from pipeline.job.layout import LayoutCheck, refusal
from pipeline.generation.training import check_sample_args

MODEL = {"variant": "gpt2", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "max_position_embeddings": 32,
         "hidden_dropout": 0.1, "attention_dropout": 0.1, "make_vocab_size_divisible_by": 8}
PROMPTS = ["def ", "import json"]


def _run(tmp_path, name, *extra):
    save = tmp_path / name
    ds = {**ds_config(), "tensorboard": {"enabled": True, "job_name": "tb"}}
    (tmp_path / "model.json").write_text(json.dumps(MODEL))
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    argv = ["--model-config", str(tmp_path / "model.json"), "--deepspeed_config", str(tmp_path / "ds.json"),
            "--data", str(write_corpus(tmp_path)), "--tokenizer", "bytes", "--seq-length", "32",
            "--lr-warmup-steps", "1", "--cache-dir", str(tmp_path / "cache"), "--tensor-parallel", "2",
            "--train-steps", "4", "--save", str(save), *extra]
    run_distributed(pretrain_worker, 2, argv, env={"OMP_NUM_THREADS": "1"})
    losses = [r["loss"] for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return save, losses


def test_samples_leave_the_losses_unchanged(tmp_path):
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    sampled_run, with_samples = _run(tmp_path, "with", "--sample-interval", "2", "--sample-prompts",
                                     str(tmp_path / "prompts.txt"), "--sample-new-tokens", "8", "--sample-top-k", "20")
    _, without = _run(tmp_path, "without")
    assert len(with_samples) == 4 and with_samples == without  # exactly: the same RNG streams

    records = [json.loads(line) for line in (sampled_run / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"], r["prompt"]) for r in records] == [
        (step, kind, p) for step in (2, 4) for kind in ("greedy", "sampled") for p in PROMPTS]
    acc = EventAccumulator(str(sampled_run / "tensorboard" / "tb"))
    acc.Reload()
    assert {"pretrain/samples_greedy/text_summary", "pretrain/samples_sampled/text_summary"} <= set(
        acc.Tags()["tensors"])

    destroy_model_parallel()
    model, tok = load_generation_model(checkpoint=sampled_run)  # saved at TP 2, read at TP 1
    ids = [tok.encode(p) for p in PROMPTS]
    for kind, settings in (("greedy", SampleSettings(8)), ("sampled", SampleSettings(8, greedy=False, top_k=20,
                                                                                     seed=1234 + 4))):
        ours = [g.new_ids for g in generate(decoder_for(model), ids, settings, eos_id=256, pad_id=256)]
        assert ours == [r["new_ids"] for r in records if r["step"] == 4 and r["kind"] == kind], kind
    destroy_model_parallel()


@pytest.mark.parametrize("given, message", [
    ({"sample_prompts": "p.txt"}, "--sample-prompts without --sample-interval"),
    ({"sample_interval": 0, "sample_prompts": "p.txt"}, "--sample-interval must be >= 1"),
    ({"sample_interval": 5}, "--sample-interval needs --sample-prompts FILE"),
])
def test_sample_arguments_are_refused_in_one_line(given, message):
    args = SimpleNamespace(sample_interval=given.get("sample_interval"), sample_prompts=given.get("sample_prompts"))
    with pytest.raises(PromptError, match=message):
        check_sample_args(args, None, None)


@pytest.mark.parametrize("layout, message", [
    (Layout(pipeline=2), "with --pipeline-parallel"), (Layout(tensor=2, sequence_parallel=True), "--sequence-parallel"),
    (Layout(zero_stage=3), "ZeRO stage 3"), (Layout(context=2), "--context-parallel"),
    (Layout(tiled_mlp=2), "--tiled-mlp"),
])
def test_layouts_without_samples_are_refused_before_the_run(layout, message):
    assert message in refusal(LayoutCheck(layout, extras={"sample_interval": 5}))
    assert refusal(LayoutCheck(layout)) is None  # the layout alone trains
