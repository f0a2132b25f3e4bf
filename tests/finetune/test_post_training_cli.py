"""The sft and dpo commands as a user runs them (python -m, torchrun): LoRA SFT at TP2 equals TP1, step for step,
through a stop signal and the rerun that continues it at TP1, samples written as it trains; its PEFT adapter, loaded by PEFT on the base's Hugging
Face model, gives the project's logits, and so does the merged export; full DPO equals the library's DPO trained
by hand on the same batches, and with the reference's log-probabilities precomputed; LoRA DPO at TP2, and from
stored reference log-probabilities, equals the library's with the base as the reference; the refusals, one line
each."""
import json
import sys
from pathlib import Path

import datasets
import pytest
import torch
from cli import cli_env, run_cli
from conftest import ROOT
from forked_cli import run_forked
from lm_utils import CONVERSATIONS, smollm2_tokenizer
from peft import LoraConfig, PeftModel
from test_dpo import PAIRS
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from finetune.lm.chat import tokenize_conversations, training_chat_template
from finetune.lm.dpo import collate_pairs, completion_logps, dpo_loss, reference_logps, tokenize_pair, tokenize_pairs
from pipeline.job.layout import POST_TRAINING
from finetune.lm.job.providers import RowIndices
from finetune.lm.packing import collate, pack_conversations
from finetune.lm.sft import sft_loss
from models import GPT, GPTConfig
from models.parallel import Layout
from pipeline.checkpoints.model_dir import read_model_dir, write_model_dir
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.data.loaders import DistributedBatchLoader
from pipeline.engine.distributed import free_port
from pipeline.hf.convert import from_hf
from pipeline.hf.peft_adapter import adapter_from_peft, add_peft_lora, read_peft_adapter
from pipeline.job.layout import LayoutCheck, refusal

BIN = Path(sys.executable).parent
STEPS, LR, BETA = 4, 1e-2, 0.1
DPO_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
SAVERS = ["--recompute", "full", "--loss-chunk-tokens", "7"]  # the memory savers: the same losses
LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj", "v_proj", "o_proj", "down_proj"]
# fp32, two micro-batches of 2 per step, DeepSpeed's torch AdamW and clipping (the DPO reference below does the same)
DS = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": 1.0,
      "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {
          "lr": LR, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True}}}


def write_chat_base(out: Path, hf_out: Path | None = None) -> Path:
    """A tiny random Llama (transformers' class) with SmolLM2-Instruct's tokenizer, imported as the project's
    model directory (and saved by transformers into ``hf_out``)."""
    tok = smollm2_tokenizer()
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False))
    if hf_out is not None:
        hf.save_pretrained(hf_out)
    config, sd = from_hf(hf)
    return write_model_dir(config, sd, out, tokenizer=tok)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny random Llama (transformers' class) with SmolLM2-Instruct's tokenizer, as Hugging Face saves it and
    as the project's import writes it; conversations and preference pairs as JSON lines."""
    d = tmp_path_factory.mktemp("post_training")
    write_chat_base(d / "base", d / "hf_base")
    (d / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 4))
    (d / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS * 4))
    (d / "ds.json").write_text(json.dumps(DS))
    return d


def _args(work, data, save, *extra):
    return ["--base", work / "base", "--data", work / data, "--deepspeed_config", work / "ds.json", "--save", save,
            "--train-steps", STEPS, "--lr", LR, "--lr-warmup-steps", "0", "--lr-decay-style", "constant", *extra]


def _steps(save):
    return [json.loads(line) for line in (Path(save) / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def _project_logits(work, out, ids):
    """The project's GPT on the base weights with the exported adapter put back on its linears."""
    config, sd, _ = read_model_dir(work / "base")
    lora, peft_sd = read_peft_adapter(out / "adapter")
    model = GPT(config).eval()
    load_full_state_dict(model, sd)
    targets = add_peft_lora(model, config, lora)
    load_full_state_dict(model, {**sd, **adapter_from_peft(peft_sd, targets)})
    return model(ids)


def test_sft_loss_takes_the_memory_savers(work):
    """--loss-chunk-tokens reaches SFT's cross-entropy and --recompute full its packed layers (the model's
    checkpoint_fn, as the engine sets it): the graph holds the chunked loss, each layer runs through the checkpoint,
    and the loss and gradients equal the plain model's."""
    config, sd, _ = read_model_dir(work / "base")
    tok = AutoTokenizer.from_pretrained(work / "base")
    chats = datasets.Dataset.from_list([{"messages": m} for m in CONVERSATIONS])
    rows = list(pack_conversations(tokenize_conversations(chats, tok, training_chat_template(tok)), 64))
    batch = collate(rows[:2], 64, tok.pad_token_id)
    calls = []

    def checkpoint(fn, *args):
        calls.append(fn)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)  # (as DeepSpeed's)

    def loss_and_grads(layout, checkpoint_fn):
        model = GPT(config, layout=layout).train()
        load_full_state_dict(model, sd)
        model.checkpoint_fn = checkpoint_fn
        loss = sft_loss(model, batch)
        graph = {type(f).__name__ for f in _graph(loss.grad_fn)}
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}, graph

    plain, plain_grads, plain_graph = loss_and_grads(Layout(), None)
    saved, saved_grads, graph = loss_and_grads(Layout(loss_chunk_tokens=7), checkpoint)
    assert "_ChunkedVocabParallelCrossEntropyBackward" in graph - plain_graph
    assert len(calls) == config.num_layers
    grad_diff = max(((saved_grads[n] - g).abs().max() / g.abs().max()).item() for n, g in plain_grads.items())
    print(f"SFT loss with the savers vs without: {abs(saved - plain).item():.1e}, gradients {grad_diff:.1e}")
    assert abs(saved - plain).item() < 1e-6 and grad_diff < 1e-5  # measured 0.0 and 0.0 (fp32)


def _graph(fn, seen=None):
    """The autograd nodes reachable from ``fn``."""
    seen = set() if seen is None else seen
    if fn is not None and fn not in seen:
        seen.add(fn)
        for next_fn, _ in fn.next_functions:
            _graph(next_fn, seen)
    return seen


def test_lora_sft_tp2_equals_tp1_through_a_stop_continued_at_tp1_and_peft_loads_the_adapter(work, tmp_path):
    """TP1 samples as it trains (which leaves its losses alone); TP2, stopped after step 2, is continued at TP1
    through a universal checkpoint with its Adam state, and every step equals TP1's."""
    tp1, tp2 = tmp_path / "tp1", tmp_path / "tp2"
    (tmp_path / "prompts.txt").write_text("Capital of France?\nSay hello.\n")
    samples = ["--sample-interval", 2, "--sample-prompts", tmp_path / "prompts.txt", "--sample-new-tokens", 3]
    done = run_cli([sys.executable, "-m", "finetune.lm.job.sft", *_args(work, "chats.jsonl", tp1, "--seq-length", 64,
                                                                         *LORA, *samples)], tmp_path)
    # the run directory as pretraining keeps it: its settings saved, one summary line and the next commands
    assert json.loads((tp1 / "args.json").read_text())["lora_r"] == 4 and (tp1 / "ds_config.json").is_file()
    assert f"done: steps 1-{STEPS}, train loss " in done.stdout and "python -m pipeline.generate --hf" in done.stdout, \
        done.stdout[-2000:]
    torchrun = [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(),
                ROOT / "finetune" / "lm" / "job" / "sft.py",
                *_args(work, "chats.jsonl", tp2, "--seq-length", 64, "--tensor-parallel", 2, *LORA, *SAVERS)]
    stopped = run_cli(torchrun, tmp_path, env=cli_env(PIPELINE_SIGNAL_AT="2"))  # SIGTERM at step 2: saved, exit 0
    assert not (tp2 / "adapter").exists(), stopped.stderr[-2000:]
    layout = json.loads((tp2 / "checkpoint" / "global_step2" / "layout.json").read_text())
    assert (layout["tensor_parallel"], layout["recompute"], layout["loss_chunk_tokens"]) == (2, "full", 7)
    continued = run_cli([sys.executable, "-m", "finetune.lm.job.sft",
                         *_args(work, "chats.jsonl", tp2, "--seq-length", 64, *LORA)], tmp_path)  # at TP1 now
    assert "(saved at TP 2, PP 1, DP 1" in continued.stderr and ") at TP 1, " in continued.stderr, continued.stderr[-2000:]
    assert not (tp2 / "checkpoint").exists()
    assert f"done: steps 3-{STEPS}, " in continued.stdout, continued.stdout[-2000:]
    first, second = _steps(tp1), _steps(tp2)
    assert [r["step"] for r in second] == [r["step"] for r in first] == list(range(1, STEPS + 1))
    diff = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(first, second))
    print(f"LoRA SFT TP2 (stopped at step 2, continued at TP1) vs TP1 (sampling): losses within {diff:.1e} "
          f"(relative)")
    assert diff < 1e-6  # measured 0.0 (this CPU sums the two halves as TP1 does); rounding would be ~1e-7; a
    # restarted Adam would change step 4's loss
    assert first[-1]["loss"] < first[0]["loss"]
    written = [json.loads(line) for line in (tp1 / "samples.jsonl").read_text().splitlines()]
    assert sorted({(r["step"], r["kind"]) for r in written}) == [(s, k) for s in (2, 4) for k in ("greedy", "sampled")]
    assert all(len(r["new_ids"]) <= 3 and r["prompt"] in ("Capital of France?", "Say hello.") for r in written)

    tok = AutoTokenizer.from_pretrained(work / "base")
    ids = torch.tensor([tok.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=True)["input_ids"]])
    ours = _project_logits(work, tp1, ids)
    base_hf = AutoModelForCausalLM.from_pretrained(work / "hf_base", dtype=torch.float32)
    peft_logits = PeftModel.from_pretrained(base_hf, tp1 / "adapter").eval()(ids).logits
    merged = AutoModelForCausalLM.from_pretrained(tp1 / "hf", dtype=torch.float32).eval()(ids).logits
    scale = ours.abs().max()
    diffs = {"peft": ((peft_logits - ours).abs().max() / scale).item(),
             "merged": ((merged - ours).abs().max() / scale).item()}
    print(f"PEFT on the base's HF model / merged HF export vs the project's logits: {diffs}")
    assert max(diffs.values()) < 3e-6  # measured: PEFT 2.8e-7, merged 3.9e-7 (fp32)
    base_only = AutoModelForCausalLM.from_pretrained(work / "hf_base", dtype=torch.float32).eval()(ids).logits
    assert ((base_only - ours).abs().max() / scale).item() > 1e-4  # the adapter trained
    _, trained, _ = read_model_dir(tp1 / "model")
    _, base, _ = read_model_dir(work / "base")
    assert torch.equal(trained["embedding.word_embeddings.weight"], base["embedding.word_embeddings.weight"])


def _library_dpo(work, lora: LoraConfig | None = None):
    """The library's DPO trained by hand: the command's batches (its loader, --seed 1234), plain AdamW; with LoRA
    the command's adapters (each linear's A drawn from --seed and its name) and the base as the reference."""
    tok = AutoTokenizer.from_pretrained(work / "base")
    rows = list(tokenize_pairs(datasets.load_dataset("json", data_files=str(work / "pairs.jsonl"), split="train"),
                               tok))
    config, sd, _ = read_model_dir(work / "base")
    policy, reference = GPT(config), None
    load_full_state_dict(policy, sd)
    if lora is None:
        reference = GPT(config).eval()
        load_full_state_dict(reference, sd)
    else:
        add_peft_lora(policy, config, lora, seed=1234)
    trained = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    loader = DistributedBatchLoader(RowIndices(len(rows), "pairs"), 2, 0, 1, seed=1234)
    steps = []
    for _ in range(STEPS):
        record = {}
        for _ in range(2):  # micro-batches
            ids, targets = collate_pairs([rows[int(i)] for i in next(loader)["tokens"][:, 0]], tok.pad_token_id)
            loss, metrics = dpo_loss(completion_logps(policy, ids, targets),
                                     reference_logps(policy, ids, targets, reference), BETA)
            (loss / 2).backward()
            for k, v in {"loss": loss.item(), **metrics}.items():
                record[k] = record.get(k, 0.0) + v / 2
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad()
        steps.append(record)
    return steps


def _dpo_diff(ours, theirs):
    """The largest difference of the logged loss and rewards, step by step (relative above 1)."""
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1)) and len(theirs) == STEPS
    return max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in zip(ours, theirs) for k in DPO_KEYS)


@pytest.fixture(scope="module")
def dpo_runs(work, tmp_path_factory):
    """Full DPO through the command: at TP1 with its reference live (a frozen copy of the base), and over two
    data-parallel ranks with the reference's log-probabilities precomputed (each rank its share, gathered)."""
    d = tmp_path_factory.mktemp("dpo")
    run_cli([sys.executable, "-m", "finetune.lm.job.dpo", *_args(work, "pairs.jsonl", d / "live", "--beta", BETA)], d)
    run_cli([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(),
             ROOT / "finetune" / "lm" / "job" / "dpo.py",
             *_args(work, "pairs.jsonl", d / "precomputed", "--beta", BETA, "--precompute-ref-log-probs")], d)
    return d


def test_dpo_command_equals_the_library_trained_by_hand(work, dpo_runs):
    out = dpo_runs / "live"
    ours, library = _steps(out), _library_dpo(work)
    diff = _dpo_diff(ours, library)
    print(f"DPO command vs the library by hand, {STEPS} steps: {diff:.1e}; losses {[r['loss'] for r in ours]}")
    assert diff < 3e-6  # measured 3.0e-7 (fp32)
    assert ours[-1]["loss"] < ours[0]["loss"] and ours[-1]["rewards/margins"] > 0
    assert (out / "hf" / "config.json").is_file() and not (out / "adapter").exists()
    assert not (out / "reference_logps.jsonl").exists()


def test_dpo_precomputed_reference_equals_the_live_one(work, dpo_runs):
    live, precomputed = _steps(dpo_runs / "live"), _steps(dpo_runs / "precomputed")
    diff = _dpo_diff(precomputed, live)
    print(f"DPO at DP2 with the reference's log-probabilities precomputed vs live at TP1, {STEPS} steps: {diff:.1e}")
    assert diff < 1e-6  # measured 0.0 (DP2 sums the two micro-batches' gradients as one process accumulates them)
    written = [json.loads(line) for line in (dpo_runs / "precomputed" / "reference_logps.jsonl").read_text()
               .splitlines()]
    assert [{k: r[k] for k in PAIRS[0]} for r in written] == PAIRS * 4  # the pairs as given, with two columns
    tok = AutoTokenizer.from_pretrained(work / "base")
    config, sd, _ = read_model_dir(work / "base")
    base = GPT(config).eval()
    load_full_state_dict(base, sd)
    with torch.no_grad():  # each pair alone through the base
        by_hand = [completion_logps(base, *collate_pairs([tokenize_pair(tok, pair)], tok.pad_token_id))
                   for pair in PAIRS * 4]
    ours = torch.tensor([[r["ref_chosen_logps"], r["ref_rejected_logps"]] for r in written])
    logps = ((ours - torch.stack(by_hand)).abs() / torch.stack(by_hand).abs()).max().item()
    print(f"the written reference log-probabilities vs the base's, pair by pair: {logps:.1e} (relative)")
    assert logps < 1e-6  # measured 0.0 (a pair alone or beside another, right-padded: the same sums)


def test_lora_dpo_at_tp2_and_from_precomputed_logps_equals_the_library(work, dpo_runs, tmp_path):
    """With LoRA the reference is the base with the adapters off: the library by hand (live reference, TP1) and
    the command at TP2 (live) agree; at TP1 from the full run's reference_logps.jsonl (the same base), each
    reference log-probability raised by 1 (which the loss cancels), only the rewards move, by -beta. TP2 runs with
    the memory savers (a frozen embedding under full recomputation still trains the adapters)."""
    tp2, stored = tmp_path / "tp2", tmp_path / "stored"
    shifted = [{**r, "ref_chosen_logps": r["ref_chosen_logps"] + 1, "ref_rejected_logps": r["ref_rejected_logps"] + 1}
               for r in map(json.loads, (dpo_runs / "precomputed" / "reference_logps.jsonl").read_text().splitlines())]
    (tmp_path / "shifted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shifted))
    run_cli([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(),
             ROOT / "finetune" / "lm" / "job" / "dpo.py",
             *_args(work, "pairs.jsonl", tp2, "--beta", BETA, "--tensor-parallel", 2, *LORA, *SAVERS)], tmp_path)
    run_cli([sys.executable, "-m", "finetune.lm.job.dpo",
             *_args(work, tmp_path / "shifted.jsonl", stored, "--beta", BETA, *LORA)], tmp_path)
    library = _library_dpo(work, LoraConfig(r=4, lora_alpha=8, target_modules=LORA[5:]))
    moved = [{**r, "rewards/chosen": r["rewards/chosen"] - BETA, "rewards/rejected": r["rewards/rejected"] - BETA}
             for r in library]
    diffs = {"TP2, live": _dpo_diff(_steps(tp2), library), "TP1, stored + 1": _dpo_diff(_steps(stored), moved)}
    print(f"LoRA DPO through the command vs the library by hand (base as reference), {STEPS} steps: {diffs}")
    assert max(diffs.values()) < 2e-6  # measured TP2 1.9e-7, stored + 1 1.9e-7 (fp32)
    assert library[-1]["loss"] < library[0]["loss"] and (tp2 / "adapter" / "adapter_config.json").is_file()


def test_refusals_in_one_line(work, tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"conversation": CONVERSATIONS[0]}) + "\n")
    (tmp_path / "same.jsonl").write_text(json.dumps({**PAIRS[0], "rejected": PAIRS[0]["chosen"]}) + "\n")
    plain = tmp_path / "plain_tokenizer"
    tok = smollm2_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(plain)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for part in ("hf", "model"):
        (tmp_path / "finished" / part).mkdir(parents=True)
    sft = "finetune.lm.job.sft"

    def args(data, *extra, save=None):
        return ["--base", work / "base", "--data", data, "--deepspeed_config", work / "ds.json", "--train-steps", 1,
                "--save", save or tmp_path / "out", *extra]

    cases = {
        "no messages field": (sft, args(tmp_path / "bad.jsonl"), "no 'messages' field"),
        "no chat template": (sft, args(work / "chats.jsonl", "--tokenizer", plain), "has no chat template"),
        "unknown target": (sft, args(work / "chats.jsonl", "--lora-target-modules", "q_projx"),
                           "'q_projx' names no linear"),
        "identical pair": ("finetune.lm.job.dpo", args(tmp_path / "same.jsonl"), "are the same"),
        "--save not empty": (sft, args(work / "chats.jsonl", save=tmp_path / "full"), "not empty"),
        "--no-resume, --save not empty": (sft, args(work / "chats.jsonl", "--no-resume", save=tmp_path / "full"),
                                          "--no-resume starts a new run in a new or empty directory only"),
        "--save finished": (sft, args(work / "chats.jsonl", save=tmp_path / "finished"),
                            "holds a finished run (model/, hf/): nothing to run"),
    }
    results = run_forked([(m, a) for m, a, _ in cases.values()], tmp_path)
    for (name, (_, _, expected)), (code, _, err) in zip(cases.items(), results):
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and expected in errors[0], (name, err[-1500:])
        assert "Traceback" not in err, name


def test_the_layout_rule_refuses_what_the_post_training_forward_does_not_do_and_nothing_else():
    pp = Layout(pipeline=2)
    assert refusal(LayoutCheck(pp, extras={POST_TRAINING: "SFT", "world": 2})) is None  # (SFT on stages)
    assert "DPO with --pipeline-parallel" in refusal(LayoutCheck(pp, extras={POST_TRAINING: "DPO", "world": 2}))
    mtp = GPTConfig(variant="llama", hidden_size=32, num_layers=2, num_heads=4, vocab_size=64,
                    max_position_embeddings=16, mtp_num_layers=1)
    assert "SFT of a model with multi-token prediction" in refusal(LayoutCheck(Layout(), mtp, extras={
        POST_TRAINING: "SFT", "world": 1}))
    for layout in (Layout(tensor=2, sequence_parallel=True), Layout(context=2), Layout(zero_stage=3, data=2),
                   Layout(expert=2, data=2), Layout(tiled_mlp=2, tiled_loss=2)):  # (test_post_training_layouts.py)
        for what in ("SFT", "DPO"):
            assert refusal(LayoutCheck(layout, extras={POST_TRAINING: what, "world": layout.world})) is None, layout
