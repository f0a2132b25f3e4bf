"""lm-evaluation-harness on project checkpoints, without an export: an ``lm_eval`` ``LM`` over the project's
scorers (``GPTScorer`` at any tensor-parallel size, fed from a checkpoint of any saved layout).

Requests are tokenized exactly as the harness's ``--model hf`` does (``TemplateLM``'s context/continuation
split, the tokenizer's own special tokens, BOS (else EOS) before an empty context, the left truncation to the
model's positions), so the same checkpoint gives the same numbers as its Hugging Face export. The harness sees
one process (rank 0 of 1) on every rank; the requests are shared out over the data-parallel replicas here
and the answers gathered, so every rank returns the full result.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from lm_eval import simple_evaluate, utils
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager

from pipeline.job.errors import UserError
from pipeline.evaluation.lm_scoring import DataShard


class HarnessError(UserError):
    pass


class ProjectLM(TemplateLM):
    """``scorer``: a project Scorer (ids -> per-token NLL and greedy ids); ``tokenizer``: a transformers
    tokenizer; ``max_length``: the positions the model reads."""

    def __init__(self, scorer, tokenizer, max_length: int, batch_size: int = 8, shard: DataShard | None = None,
                 name: str = "project"):
        super().__init__()
        self.scorer, self.tokenizer, self.max_length = scorer, tokenizer, max_length
        self.batch_size, self.shard, self.name = batch_size, shard or DataShard(), name
        self._device = scorer.device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", self.name)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):  # already has its BOS
            kwargs["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, **kwargs))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request."""
        seqs = [((list(ctx) + list(cont))[-(self.max_length + 1):], len(cont)) for _, ctx, cont in requests]
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))  # similar lengths batch together
        batches = self.shard.take([order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)])
        mine = {}
        for batch in batches:
            width = max(len(seqs[i][0]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)  # right padding: a causal model ignores it
            for row, i in zip(ids, batch):
                row[:len(seqs[i][0])] = torch.tensor(seqs[i][0])
            out = self.scorer(ids, greedy=True)
            nll, greedy = out.nll.double().cpu(), out.greedy.cpu()
            for r, i in enumerate(batch):
                seq, n = seqs[i]
                span = slice(len(seq) - 1 - n, len(seq) - 1)  # position t predicts token t + 1
                mine[i] = (-nll[r, span].sum().item(), bool((greedy[r, span] == torch.tensor(seq[-n:])).all()))
        answers = self._gather(mine)
        results = [answers[i] for i in range(len(seqs))]
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _gather(self, mine: dict) -> dict:
        if self.shard.size == 1:
            return mine
        parts = [None] * self.shard.size
        dist.all_gather_object(parts, mine, group=self.shard.group)
        return {k: v for part in parts for k, v in part.items()}

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood in disjoint windows of the model's length, as ``--model hf`` scores it."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise HarnessError("the project adapter scores log-likelihoods only (multiple choice, LAMBADA, perplexity); "
                           "for generation tasks export the checkpoint (python -m pipeline.export_hf) and run "
                           "lm_eval --model hf on it")


def run_harness(lm: ProjectLM, tasks: Sequence[str], *, include_path: Path | None = None,
                limit: int | None = None, num_fewshot: int | None = None, log_samples: bool = False) -> dict:
    """The harness's own tasks (from its registry, or from YAML files under ``include_path``) on ``lm``:
    {"results": per task metrics, "versions", "n-shot", "samples": per task [{doc_id, target, resps}]}."""
    manager = _task_manager(tasks, include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = f" nor under --include-path {include_path}" if include_path else ""
        raise HarnessError(f"--harness: unknown task(s) {', '.join(unknown)}: not in lm-eval's registry{where}; "
                           f"give a folder of task YAML files with --include-path")
    try:
        out = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                              log_samples=log_samples, batch_size=lm.batch_size, bootstrap_iters=0)
    except ConnectionError as e:  # datasets' "Couldn't reach 'org/name' on the Hub (OfflineModeIsEnabled)"
        raise data_unreachable(tasks, e) from None
    return _from_rank0(_record(out, log_samples) if out is not None else None)


def data_unreachable(tasks: Sequence[str], error: ConnectionError) -> HarnessError:
    """One line for a task whose data set would have to be downloaded (offline, or no network)."""
    found = re.search(r"reach '([^']+)'", str(error))
    dataset = f"its data set {found.group(1)}" if found else "a data set it reads"
    offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if os.environ.get(v, "0") not in ("", "0")]
    why, remedy = ((f"downloads are off ({', '.join(f'{v}=1' for v in offline)})",
                    f"unset {' and '.join(offline)} and run the command once online to cache it") if offline else
                   ("the Hub cannot be reached", "run the command once with network access to cache it"))
    return HarnessError(f"--harness {','.join(tasks)}: {dataset} is not in the local Hugging Face cache and {why}; "
                        f"{remedy}, or give --include-path a folder of task YAML files that read local data files")


def _task_manager(tasks: Sequence[str], include_path: Path | None) -> TaskManager:
    """lm-eval's task index: of ``include_path`` alone when every task is one of its own tasks (named exactly, not
    a group, tag or pattern, which may reach lm-eval's tasks), else of lm-eval's tasks too. Indexing lm-eval's
    task YAML files (about 14,000) takes about 20 s on a small CPU; a task of ``include_path`` would be taken
    from there either way (later paths override)."""
    if include_path:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(tasks) <= set(local.all_subtasks):
            return local
    return TaskManager(include_path=str(include_path) if include_path else None)


def _record(out: dict, log_samples: bool) -> dict:
    record = {key: out.get(key) for key in ("results", "versions", "n-shot", "configs") if key in out}
    record["configs"] = {t: {k: str(v) for k, v in c.items()} for t, c in (record.get("configs") or {}).items()}
    if log_samples:
        record["samples"] = {task: [{"doc_id": s["doc_id"], "target": s.get("target"),
                                     "resps": [list(r) if isinstance(r, tuple) else r for r in s["filtered_resps"]]}
                                    for s in samples] for task, samples in out["samples"].items()}
    return record


def _from_rank0(record: dict | None) -> dict:
    """Every rank gets global rank 0's record: the harness aggregates on the processes whose LOCAL_RANK is 0
    only (it assumes the other local ranks are tensor-parallel peers that need no result) and returns None on
    the rest."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return record
    box = [record if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
