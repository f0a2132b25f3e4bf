"""Decoding with the KV cache is exact: greedy continuations of left-padded batches equal transformers'
``generate(do_sample=False)`` on the export token for token (fp32, gpt2 and llama with GQA) at TP 1 and TP 2
over gloo, with and without the cache; a seeded sample is the same at TP 1 and TP 2 and differs with the seed."""
import pytest
import torch
from dist import run_distributed
from gen_utils import EOS, PROMPTS, hf_greedy, make_model_dirs

from models.parallel import destroy_model_parallel
from pipeline.generation.decode import generate
from pipeline.generation.decoders import decoder_for
from pipeline.generation.loading import load_generation_model
from pipeline.generation.sampling import SampleSettings

NEW = 16
SAMPLED = [SampleSettings(NEW, greedy=False, temperature=0.8, top_k=40, top_p=0.9, seed=s) for s in (1, 2)]


def _decode(rank, tp, dirs):
    """Greedy (cache, no cache, each prompt alone) and seeded samples of each model at ``tp``."""
    out = {}
    for name, (project, hf) in dirs.items():
        destroy_model_parallel()
        # the gpt2 model from its project directory, the llama one from its Hugging Face export
        model, _ = (load_generation_model(checkpoint=project, tensor_parallel=tp) if name == "gpt2" else
                    load_generation_model(hf=hf, tensor_parallel=tp))
        def run(prompts, settings, cache=True):
            return [g.new_ids for g in generate(decoder_for(model, cache), prompts, settings, eos_id=EOS)]
        out[name] = {"greedy": run(PROMPTS, SampleSettings(NEW)), "no_cache": run(PROMPTS, SampleSettings(NEW), False),
                     "alone": [run([p], SampleSettings(NEW))[0] for p in PROMPTS],
                     "sampled": [run(PROMPTS, s) for s in SAMPLED]}
    destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    dirs = {name: make_model_dirs(root, name) for name in ("gpt2", "llama-gqa")}
    theirs = {name: hf_greedy(hf, PROMPTS, NEW) for name, (_, hf) in dirs.items()}
    return dirs, theirs, _decode(0, 1, dirs)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_greedy_equals_transformers_at_tp1(setup, name):
    _, theirs, tp1 = setup
    ours = tp1[name]
    assert sum(map(len, theirs[name])) >= 2 * NEW and len({tuple(r) for r in theirs[name]}) == len(PROMPTS)
    assert ours["greedy"] == theirs[name]
    assert ours["no_cache"] == theirs[name]
    assert ours["alone"] == theirs[name]  # left padding changes nothing


def test_tp2_greedy_equals_transformers_and_samples_equal_tp1(setup):
    dirs, theirs, tp1 = setup
    for rank, res in enumerate(run_distributed(_decode, 2, 2, dirs, env={"OMP_NUM_THREADS": "1"})):
        for name in dirs:
            assert res[name]["greedy"] == theirs[name], (rank, name)
            assert res[name]["no_cache"] == theirs[name], (rank, name)
            assert res[name]["sampled"] == tp1[name]["sampled"], (rank, name)
    for name in dirs:
        first, second = tp1[name]["sampled"]
        assert first != second and first != tp1[name]["greedy"]  # the seed matters, and sampling is not argmax


def test_sampling_leaves_the_global_rng_alone():
    logits = torch.randn(3, 50)
    state = torch.random.get_rng_state()
    from pipeline.generation.sampling import next_tokens  # noqa: PLC0415
    a = next_tokens(logits, SAMPLED[0], torch.Generator().manual_seed(5))
    b = next_tokens(logits, SAMPLED[0], torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and torch.equal(torch.random.get_rng_state(), state)
    top1 = next_tokens(logits, SampleSettings(greedy=False, top_k=1), torch.Generator().manual_seed(0))
    assert torch.equal(top1, logits.argmax(-1))
