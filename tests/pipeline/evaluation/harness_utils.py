"""Local lm-evaluation-harness tasks read offline (the harness's lambada_openai definition on the first LAMBADA
passages, and a 4-way choice of the last word), and the comparison of two harness answers: accuracy equal, the
same greedy answers, every log-likelihood within a tolerance."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from conftest import shared_data

TASKS = ("lambada_local", "lambada_choice")
LAMBADA_YAML = """task: lambada_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
CHOICE_YAML = """task: lambada_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(d: Path, passages: int) -> Path:
    """``TASKS`` over the first ``passages`` LAMBADA passages: their data in ``d`` (``lambada.jsonl``, also a
    training text, and ``choice.jsonl``), their YAML files in ``d/tasks`` (returned, for ``--include-path``)."""
    texts = [json.loads(line)["text"] for line in shared_data("lambada", "test.jsonl").read_text().splitlines()
             [:passages]]
    (d / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    rng, words = random.Random(0), [t.split(" ")[-1] for t in texts]
    with open(d / "choice.jsonl", "w") as f:
        for i, t in enumerate(texts):
            choices = [words[i]] + rng.sample([w for w in words if w != words[i]], 3)
            rng.shuffle(choices)
            f.write(json.dumps({"context": " ".join(t.split(" ")[:-1]), "choices": choices,
                                "label": choices.index(words[i])}) + "\n")
    tasks = d / "tasks"
    tasks.mkdir()
    (tasks / "lambada_local.yaml").write_text(LAMBADA_YAML.format(data=d / "lambada.jsonl"))
    (tasks / "lambada_choice.yaml").write_text(CHOICE_YAML.format(data=d / "choice.jsonl"))
    return tasks


def record_answers(record: dict) -> tuple[dict, dict]:
    """A ``pipeline.evaluate --harness --log-samples`` record as (results, {task: {doc_id: answers}})."""
    return record["results"], {task: {s["doc_id"]: s["resps"] for s in record["samples"][task]} for task in TASKS}


def check_against(record: dict, reference: tuple[dict, dict], passages: int, tol: float) -> float:
    """``record`` (``pipeline.evaluate --harness --log-samples``) against ``reference`` (results, {task: {doc_id:
    answers}}): every document answered, the same accuracies and greedy answers, the perplexity to 1e-5 and every
    log-likelihood within ``tol``; prints and returns the largest log-likelihood difference."""
    results, samples = reference
    ours_results, ours_samples = record_answers(record)
    worst = 0.0
    for task in TASKS:
        assert ours_results[task]["acc,none"] == results[task]["acc,none"], task
        assert sorted(ours_samples[task]) == sorted(samples[task]) == list(range(passages))
        for doc, resps in ours_samples[task].items():
            for (ll, greedy), (ref_ll, ref_greedy) in zip(resps, samples[task][doc]):
                worst = max(worst, abs(ll - float(ref_ll)))
                assert str(greedy) == str(ref_greedy), (task, doc)
    assert ours_results["lambada_local"]["perplexity,none"] == pytest.approx(
        results["lambada_local"]["perplexity,none"], rel=1e-5)
    assert worst < tol, f"max |log-likelihood difference| {worst:.2e}"
    assert 0 < results["lambada_choice"]["acc,none"] < 1  # the comparison is not between two constants
    print(f"max |log-likelihood difference| {worst:.2e}; choice accuracy {results['lambada_choice']['acc,none']}",
          file=sys.stderr)
    return worst
