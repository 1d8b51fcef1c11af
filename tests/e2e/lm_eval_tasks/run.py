"""Run lm-evaluation-harness on two small tasks (no download) and write each task's metrics
and per-item responses as JSON: `python -m tests.e2e.lm_eval_tasks.run OUT MODEL MODEL_ARGS
GREEDY_JSONL`. The multiple-choice task reads this folder's items.jsonl; the loglikelihood one
reads GREEDY_JSONL (the test writes it: some targets are the model's greedy continuation). A
process of its own: lm-eval imports much and keeps state."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# A multiple-choice task (acc: the choice of highest loglikelihood) and a loglikelihood one
# (acc: whether the target is the greedy continuation, read from top_logprobs).
TASKS = {
    "kvferry_tiny_choice": """
dataset_kwargs:
  data_files:
    test: ITEMS
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "kvferry_tiny_greedy": """
dataset_kwargs:
  data_files:
    test: GREEDY
output_type: loglikelihood
doc_to_text: "{{question}}"
doc_to_target: "{{target}}"
metric_list:
  - metric: acc
""",
}


def write_tasks(folder: Path, greedy: str) -> None:
    for name, body in TASKS.items():
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ntest_split: test\n"
            + body.replace("ITEMS", str(HERE / "items.jsonl")).replace("GREEDY", greedy))


def main(out: str, model: str, model_args: str, greedy: str) -> None:
    import tempfile

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as folder:
        write_tasks(Path(folder), greedy)
        results = simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                  batch_size=1, device="cpu", log_samples=True,
                                  task_manager=TaskManager(include_path=folder))
    assert results is not None
    Path(out).write_text(json.dumps({
        "metrics": results["results"],
        "responses": {task: [[list(r) for resp in sample["resps"] for r in resp]
                             for sample in sorted(samples, key=lambda s: s["doc_id"])]
                      for task, samples in results["samples"].items()},
    }))


if __name__ == "__main__":
    main(*sys.argv[1:5])
