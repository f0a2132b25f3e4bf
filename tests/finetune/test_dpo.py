"""DPO: on a fixed batch of conversational pairs (SmolLM2's tokenizer), the project's tokenization, loss and reward
metrics equal TRL 1.16's DPOTrainer (its _compute_loss, the sigmoid loss) with a separate reference model, and with
LoRA, whose reference is the base with the adapters off; 5 full steps equal DPOTrainer's; an identical pair is
refused."""
import datasets
import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer

from finetune.lm.dpo import (PreferenceDataError, collate_pairs, completion_logps, dpo_loss, reference_logps,
                             tokenize_pair, tokenize_pairs)
from lm_utils import smollm2_tokenizer
from models import GPT
from models.parallel import destroy_model_parallel, full_state_dict, initialize_model_parallel
from pipeline.checkpoints.state_dicts import load_full_state_dict
from pipeline.hf.convert import from_hf
from pipeline.hf.peft_adapter import adapter_from_peft, add_peft_lora

BETA = 0.1
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
PAIRS = [
    {"prompt": [{"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris."}],
     "rejected": [{"role": "assistant", "content": "Lyon, I think."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
     "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "5, or maybe 22"}]},
    {"prompt": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "Again?"}],
     "chosen": [{"role": "assistant", "content": "Hi again!"}],
     "rejected": [{"role": "assistant", "content": "No."}]},
]


def _hf(seed, vocab):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                        initializer_range=0.2))


def _project(hf):
    config, full_sd = from_hf(hf)
    config = type(config)(**{**config.__dict__, "hidden_dropout": 0.0, "attention_dropout": 0.0})
    model = GPT(config, init_seed=1)
    load_full_state_dict(model, full_sd)
    return model, config


def _trainer(model, ref_model, tok, tmp_path, peft_config=None):
    args = DPOConfig(output_dir=str(tmp_path), beta=BETA, report_to="none", use_cpu=True, max_length=None, bf16=False)
    return DPOTrainer(model=model, ref_model=ref_model, args=args, processing_class=tok, peft_config=peft_config,
                      train_dataset=datasets.Dataset.from_list(PAIRS))


def _trl(trainer):
    """TRL's tokenized pairs, loss and logged metrics on the batch of all PAIRS."""
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, trainer.data_collator(rows), return_outputs=False)
    return rows, loss.item(), {k: trainer._metrics["train"][k][-1] for k in METRICS}


def _compare(ours, trl, label):
    (our_rows, our_loss, our_metrics), (rows, loss, metrics) = ours, trl
    for r, ref in zip(our_rows, rows):
        assert all(r[k] == ref[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    diffs = {"loss": abs(our_loss - loss), **{k: abs(our_metrics[k] - metrics[k]) for k in METRICS}}
    print(f"{label}: loss {our_loss:.7f} (TRL {loss:.7f}); metrics {our_metrics}; differences {diffs}")
    # measured: <= 7.5e-07 (fp32); the rewards are beta x differences of log-prob sums near -80, whose fp32 spacing
    # is 7.6e-06: the bound 1e-6 is one rounding of those sums
    assert max(diffs.values()) < 1e-6
    assert abs(metrics["rewards/margins"]) > 1e-2  # the policy and the reference differ: the batch tests something


def _ours(model, tok, reference=None):
    rows = list(tokenize_pairs(datasets.Dataset.from_list(PAIRS), tok))
    ids, targets = collate_pairs(rows, tok.pad_token_id)
    model.train()
    loss, metrics = dpo_loss(completion_logps(model, ids, targets), reference_logps(model, ids, targets, reference),
                             BETA)
    return rows, loss.item(), metrics


def test_dpo_equals_trl_with_a_reference_model(tmp_path):
    tok = smollm2_tokenizer()
    policy, ref = _hf(0, len(tok)), _hf(1, len(tok))
    destroy_model_parallel()
    initialize_model_parallel(tensor_parallel=1)
    ours = _ours(_project(policy)[0], tok, _project(ref)[0].eval())
    destroy_model_parallel()
    _compare(ours, _trl(_trainer(policy, ref, tok, tmp_path)), "reference model")


def test_dpo_with_lora_equals_trl(tmp_path):
    """A new adapter (TRL's peft_config), drawn away from the base (init_lora_weights=False) so that the policy and
    its reference, the base with the adapters off, differ; the project's adapter is TRL's."""
    tok = smollm2_tokenizer()
    base = _hf(0, len(tok))
    destroy_model_parallel()
    initialize_model_parallel(tensor_parallel=1)
    model, config = _project(base)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    trainer = _trainer(base, None, tok, tmp_path, peft_config=lora)
    targets = add_peft_lora(model, config, lora)
    load_full_state_dict(model, {**dict(model.state_dict()),
                                 **adapter_from_peft(get_peft_model_state_dict(trainer.model), targets)})
    ours = _ours(model, tok)
    destroy_model_parallel()
    _compare(ours, _trl(trainer), "LoRA, the base as reference")


class _RecordingDPOTrainer(DPOTrainer):
    """TRL's trainer, keeping each step's loss at full precision (the Trainer's log rounds it)."""

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        self.recorded_losses = getattr(self, "recorded_losses", []) + [loss.item()]
        return loss


def test_dpo_steps_equal_dpo_trainer(tmp_path):
    """5 full-finetuning steps (AdamW, constant LR, no clipping, every pair in each batch): the losses and the final
    weights equal DPOTrainer's."""
    tok = smollm2_tokenizer()
    policy, ref = _hf(0, len(tok)), _hf(1, len(tok))
    destroy_model_parallel()
    initialize_model_parallel(tensor_parallel=1)
    model, reference = _project(policy)[0], _project(ref)[0].eval()
    rows = list(tokenize_pairs(datasets.Dataset.from_list(PAIRS), tok))
    ids, targets = collate_pairs(rows, tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for _ in range(5):
        loss, _ = dpo_loss(completion_logps(model, ids, targets), reference_logps(model, ids, targets, reference),
                           BETA)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ours = full_state_dict(model)
    destroy_model_parallel()
    args = DPOConfig(output_dir=str(tmp_path), beta=BETA, report_to="none", use_cpu=True, max_length=None, bf16=False,
                     learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
                     per_device_train_batch_size=len(PAIRS), max_steps=5, save_strategy="no", seed=0)
    trainer = _RecordingDPOTrainer(model=policy, ref_model=ref, args=args, processing_class=tok,
                                   train_dataset=datasets.Dataset.from_list(PAIRS))
    trainer.train()
    theirs = from_hf(trainer.model)[1]
    loss_diff = max(abs(a - b) for a, b in zip(losses, trainer.recorded_losses))
    weight_diff = max((ours[k] - v).abs().max().item() for k, v in theirs.items())
    print(f"DPO 5 steps: losses {losses} (TRL {trainer.recorded_losses}); max differences: losses {loss_diff:.1e}, "
          f"weights {weight_diff:.1e}")
    assert len(trainer.recorded_losses) == 5
    assert losses[-1] < losses[0] - 0.1  # the steps did something
    assert loss_diff < 2e-6 and weight_diff < 1e-5  # measured: 2.4e-07, 3.6e-06 (fp32, weights of magnitude ~1)


def test_identical_pair_refused():
    tok = smollm2_tokenizer()
    same = {**PAIRS[0], "rejected": PAIRS[0]["chosen"]}
    with pytest.raises(PreferenceDataError, match="pair 1: the chosen and the rejected completion are the same"):
        tokenize_pairs(datasets.Dataset.from_list([PAIRS[1], same]), tok)
    with pytest.raises(PreferenceDataError, match="no 'rejected' field"):
        tokenize_pair(tok, {"prompt": "a", "chosen": "b"})
