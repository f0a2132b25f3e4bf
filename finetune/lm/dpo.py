"""Direct preference optimisation (Rafailov et al. 2023) as TRL 1.16's ``DPOTrainer`` computes it with its default
sigmoid loss: pairs tokenized as TRL tokenizes them, each completion's summed log-probability under the policy
and under a frozen reference (another model, or with LoRA the same model with its adapters off), the loss
``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` averaged over the pairs, and the metrics TRL logs
under the same names.

A pair is ``prompt``, ``chosen``, ``rejected``: conversations (lists of messages, the prompt rendered with the
generation prompt) or plain text (an end-of-sequence token appended to each completion, as TRL does). The
completion starts where the tokenized prompt and prompt + completion part (TRL's ``common_prefix_length``).

The reference's log-probabilities may come precomputed, as TRL's ``precompute_ref_log_probs`` adds them: a pair's
``ref_chosen_logps`` and ``ref_rejected_logps`` (TRL's column names) are then used instead of a reference forward.
"""
from __future__ import annotations

import contextlib

import datasets
import torch
import torch.nn.functional as F
from trl.data_utils import common_prefix_length, is_conversational

from finetune.lm.chat import IGNORE_INDEX
from models.lora import lora_adapters, lora_disabled
from pipeline.job.errors import UserError

PAIR_FIELDS = ("prompt", "chosen", "rejected")
REFERENCE_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")  # TRL's columns of precomputed reference logps


class PreferenceDataError(UserError, ValueError):
    """A preference pair that DPO cannot learn from."""


def tokenize_pair(tokenizer, pair: dict, where: str = "pair") -> dict:
    """``prompt_ids``, ``chosen_ids``, ``rejected_ids`` of one pair."""
    missing = [f for f in PAIR_FIELDS if f not in pair]
    if missing:
        raise PreferenceDataError(f"{where}: no {', '.join(repr(f) for f in missing)} field; give each pair a "
                                  f"prompt, a chosen and a rejected completion")
    if is_conversational(pair):
        prompt = _render(tokenizer, pair["prompt"], add_generation_prompt=True)
        chosen, rejected = (_render(tokenizer, pair["prompt"] + pair[k]) for k in ("chosen", "rejected"))
    else:
        eos = tokenizer.eos_token
        prompt = tokenizer(pair["prompt"])["input_ids"]
        chosen, rejected = (tokenizer(pair["prompt"] + (t if t.endswith(eos) else t + eos))["input_ids"]
                            for t in (pair["chosen"], pair["rejected"]))
    cut = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
    out = {"prompt_ids": list(prompt[:cut]), "chosen_ids": list(chosen[cut:]), "rejected_ids": list(rejected[cut:])}
    if out["chosen_ids"] == out["rejected_ids"]:
        raise PreferenceDataError(f"{where}: the chosen and the rejected completion are the same; DPO learns "
                                  f"nothing from it, drop the pair")
    return {**out, **_stored_reference(pair, where)}


def _stored_reference(pair: dict, where: str) -> dict:
    """The pair's precomputed reference log-probabilities, if it carries them (both, as numbers)."""
    present = [f for f in REFERENCE_FIELDS if pair.get(f) is not None]
    if not present:
        return {}
    if len(present) < len(REFERENCE_FIELDS) or not all(isinstance(pair[f], (int, float)) for f in present):
        raise PreferenceDataError(f"{where}: {' and '.join(repr(f) for f in REFERENCE_FIELDS)} must both be numbers "
                                  f"(the reference's summed log-probabilities); give both, or neither")
    return {f: float(pair[f]) for f in REFERENCE_FIELDS}


def _render(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]


def tokenize_pairs(pairs: datasets.Dataset, tokenizer, num_proc: int | None = None) -> datasets.Dataset:
    return pairs.map(_TokenizePair(tokenizer), with_indices=True, remove_columns=pairs.column_names,
                     num_proc=num_proc, desc="tokenizing preference pairs")


class _TokenizePair:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, pair: dict, index: int) -> dict:
        return tokenize_pair(self.tokenizer, pair, f"pair {index}")


def collate_pairs(rows: list[dict], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` [2b, s] (the b prompt + chosen rows, then the b prompt + rejected rows, padded on the right)
    and ``targets`` [2b, s - 1]: the next token where it is a completion token, -100 elsewhere. ``multiple``: the
    model reads ``s - 1`` tokens, padded up to a multiple of it (what sequence and context parallelism split)."""
    seqs = [r["prompt_ids"] + r["chosen_ids"] for r in rows] + [r["prompt_ids"] + r["rejected_ids"] for r in rows]
    prompts = [len(r["prompt_ids"]) for r in rows] * 2
    width = -(-(max(len(s) for s in seqs) - 1) // multiple) * multiple + 1
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
        ids[i, :len(seq)] = torch.tensor(seq)
        targets[i, prompt:len(seq)] = ids[i, prompt:len(seq)]
    return ids, targets[:, 1:]


def stored_reference_logps(rows: list[dict]) -> torch.Tensor | None:
    """The precomputed reference log-probabilities of a batch, ordered as ``collate_pairs``'s rows (chosen, then
    rejected), or None when the rows carry none."""
    if REFERENCE_FIELDS[0] not in rows[0]:
        return None
    return torch.tensor([r[f] for f in REFERENCE_FIELDS for r in rows], dtype=torch.float32)


@torch.no_grad()
def precompute_reference_logps(model, rows: list[dict], batch_size: int, pad_id: int, reference=None,
                               device=None, multiple: int = 1) -> list[dict]:
    """``rows`` with each pair's ``ref_chosen_logps`` and ``ref_rejected_logps`` (TRL's ``precompute_ref_log_probs``):
    ``reference`` (or ``model`` with its LoRA adapters off) over ``batch_size`` pairs at a time."""
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids, targets = collate_pairs(chunk, pad_id, multiple)
        chosen, rejected = reference_logps(model, ids.to(device), targets.to(device), reference).float().cpu().chunk(2)
        out += [{**r, REFERENCE_FIELDS[0]: c, REFERENCE_FIELDS[1]: j}
                for r, c, j in zip(chunk, chosen.tolist(), rejected.tolist())]
    return out


def completion_logps(model, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its completion tokens under the project's GPT (any TP / CP layout:
    the model's own cross-entropy summed per row, tiled under ``--tiled-loss``)."""
    return -model(input_ids[:, :-1], targets, reduction="row_sum")


def reference_logps(model, input_ids: torch.Tensor, targets: torch.Tensor, reference=None) -> torch.Tensor:
    """The frozen reference's: ``reference`` when given, else ``model`` with its LoRA adapters off."""
    if reference is None and not lora_adapters(model):
        raise ValueError("DPO needs a reference model, or LoRA adapters on the policy (the base is the reference)")
    with torch.no_grad(), (lora_disabled(model) if reference is None else contextlib.nullcontext()):
        return completion_logps(reference if reference is not None else model, input_ids, targets)


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict]:
    """The sigmoid DPO loss of a batch [chosen rows; rejected rows] and TRL's reward metrics (means over pairs)."""
    chosen, rejected = policy_logps.chunk(2)
    ref_chosen, ref_rejected = reference_logps.chunk(2)
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    loss = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()
    chosen_rewards, rejected_rewards = beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    metrics = {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
               "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
               "logps/chosen": chosen.detach().mean().item(), "logps/rejected": rejected.detach().mean().item()}
    return loss, metrics
