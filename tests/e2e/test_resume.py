"""A TRL user's job, killed outright (every process SIGKILLed, as in a power cut) and run again
in its run folder: it resumes, learns like a clean run, and its trackers carry on.

The job is examples/trl/tiny-dataset.yaml (the default task as a JSONL file and a reward
function with GRPOTrainer's signature, on the warm-started tiny model) with W&B (offline),
MLflow and TensorBoard tracking: 40 steps, checkpoint every 10, killed at step 12 (two steps to
replay). Measured with the built-in task before the dataset one existed: a clean run went from
27.3% to 38.3% held-out accuracy, a resumed one to 39.7%; before generators continued their books
from the stream, the resumed run trained no tokens from step 19 on (every sample dropped for lag)
and ended at 19.7%.

"It learns" is read from the chance that sampling writes each held-out answer exactly (1,000
problems), computed from the weights: no sampling noise, so what varies is the training alone.
Four runs (one in a full CI suite, three alone; 2026-12-05, 2-core EPYC) took it from 0.182 to
0.292, 0.276, 0.263 and 0.273 (+0.08 to +0.11); with the trainer's broadcast on a thread, two
alone +0.107 and +0.104, two beside two busy processes +0.115 and +0.112, and two in full CI
suites +0.096 and +0.043 (2026-12-06, 2-core Xeon;
that run's training reward still rose, 0.32 to 0.39 over its first and last ten steps, with no
sample dropped and ESS 0.985), so the bound is +0.03. What this test asserted before, the mean training
reward of the last ten steps against the first ten, rose +6, +10, +11 and +13 points in those
runs and +5 in a loaded CI run that failed its +5 bound: 128 samples a step of 16 prompts is too
few to read a rise of ~10 points off twice ten steps. Greedy accuracy swings with small weight
changes (three runs gained +12.0, +10.7 and +3.7 points on 300 problems), so it is asserted
only not to fall."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from jobs import RUN_TIMEOUT_S, stored  # tests/e2e/jobs.py
from wandb_records import wandb_history  # tests/wandb_records.py

from pipelinerl import messages as m
from pipelinerl.tiny_model import resolve_model_path
from pipelinerl.tracking import default_mlflow_uri

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT, KILL_AT = 40, 10, 12


def held_out_problems() -> list:
    """The arith task's first 1,000 held-out problems (3 digits, no carry out, as the warm start
    learned): the example's test file is the first 300 of them."""
    from pipelinerl.tasks.arith import ArithTask

    return ArithTask(carry_out=False).test_problems(1000)


def job() -> dict:
    manifest = yaml.safe_load((ROOT / "examples" / "trl" / "tiny-dataset.yaml").read_text())
    # Every checkpoint's weights exported too: the checkpoints themselves are pruned to the newest two.
    manifest["spec"]["trainer"] |= {"maxSteps": STEPS, "checkpointInterval": CHECKPOINT, "exportInterval": CHECKPOINT}
    manifest["spec"]["eval"]["interval"] = STEPS
    manifest["spec"]["tracking"]["mlflow"] = {}
    return manifest


def answer_chance(weights: Path, warm: str) -> float:
    """Mean over the held-out problems of the chance that sampling writes exactly the answer
    (the warm start's tokenizer: an export's folder does not say it is a built-in model's)."""
    from transformers import AutoModelForCausalLM

    from pipelinerl.tiny_model import answer_probability, load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(weights).eval()
    chances = answer_probability(model, load_tokenizer(warm), held_out_problems())
    return sum(chances) / len(chances)


def logprob_gap(weights: Path, batches: list[m.MicroBatch]) -> float:
    """Largest |recorded − recomputed| sampling logprob of the batches' generated tokens under
    a version's exported weights (temperature 1, as the job samples)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights).eval()
    gap = 0.0
    for mb in batches:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([mb.tokens]), position_ids=torch.tensor([mb.positions])).logits[0]
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(mb.tokens[1:])[:, None])[:, 0]
        mask = torch.tensor(mb.mask[1:]).bool()
        gap = max(gap, float((lp[mask] - torch.tensor(mb.logprobs[1:])[mask]).abs().max()))
    return gap


def test_a_run_killed_outright_resumes_learns_like_a_clean_one_and_keeps_tracking(monkeypatch, start_run):
    monkeypatch.chdir(ROOT)  # the manifest names its data and reward module from the repository root
    monkeypatch.setenv("WANDB_SILENT", "true")
    manifest = job()
    first = start_run(manifest, timeout_s=RUN_TIMEOUT_S)
    first.wait_step(KILL_AT)
    first.kill_everything()
    killed_at = first.train()[-1]["step"]
    before = len(first.train())

    second = start_run(manifest, timeout_s=RUN_TIMEOUT_S)
    second.finish()
    summary = json.loads((second.dir / "summary.json").read_text())
    # The second run's own rows (on its clock): those it read of the first's, published as that one
    # was killed and not yet written, came before it started.
    rows = second.train()[before:]
    resumed = [r for r in rows if r["time"] >= 0]
    killed_at = max([killed_at] + [r["step"] for r in rows if r["time"] < 0])
    resumed_at = resumed[0]["step"] - 1
    assert resumed_at == CHECKPOINT * (killed_at // CHECKPOINT)  # the newest checkpoint
    # Versions are monotone from the checkpoint on, and every step trains a full batch at the
    # lag bound, as in a clean run. One group went past maxLag in 1 of 10 repeated runs, 8 steps
    # after the resume, and was dropped by the preprocessor: likely one the killed preprocessor
    # held, redelivered after the 30 s ack wait behind newer groups (a restarted preprocessor now
    # takes those at once, test_preprocessor). Before generators continued their books, every
    # sample from step 19 on was dropped; two groups' worth is the bound.
    assert [r["step"] for r in resumed] == list(range(resumed_at + 1, STEPS + 1))
    assert all(r["samples"] == 128 and r["tokens"] > 0 for r in resumed)
    assert sum(r["dropped_for_lag"] for r in resumed) <= 16, [(r["step"], r["dropped_for_lag"]) for r in resumed]
    assert all(r["lag_max"] <= 1 for r in resumed)
    assert summary["learning_alarm"] is None
    # Both generators forked their engine core, the dataset task loaded after it (its loader
    # starts threads, which would make the core spawn: ~10 s more of each start).
    assert (second.dir / "logs" / "generator.log").read_text().count("engine core: fork") == 2

    batches = [m.decode(x.data, m.MicroBatch) for x in stored(second.dir, manifest["metadata"]["name"], "BATCHES")]
    batches = [b for b in batches if not b.is_sentinel]
    # No prompt group is trained in two steps (the steps replayed after the resume are the
    # stored ones, the same groups in the same steps).
    steps_of: dict[str, set[int]] = {}
    for b in batches:
        for gid in b.group_ids:
            steps_of.setdefault(gid, set()).add(b.step)
    assert len(steps_of) >= STEPS * 16 and all(len(s) == 1 for s in steps_of.values())
    # The tokens labelled with a checkpoint's version were sampled from exactly its weights
    # (the generator's label is the weights it holds); a neighbour's differ clearly. Read off
    # micro-batches whose every token has that label: a sequence that spans an update was
    # written beside a KV cache of older weights. A version whose few steps packed none such is
    # passed over (version 20 once, 2026-12-07, with other processes busy beside the run).
    exported = second.dir / "checkpoints" / "export"
    checked = 0
    for version in (CHECKPOINT, 2 * CHECKPOINT, 3 * CHECKPOINT):
        labelled = [b for b in batches if {v for v, k in zip(b.versions, b.mask) if k} == {version}][:4]
        if labelled:
            checked += 1
            assert logprob_gap(exported / f"version-{version}", labelled) < 1e-3
            assert logprob_gap(exported / f"version-{version + CHECKPOINT}", labelled) > 0.1
    assert checked >= 2, "too few micro-batches of one version to check the labels against"
    assert sorted(d.name for d in (second.dir / "checkpoints").glob("step-*")) == [
        f"step-{STEPS - CHECKPOINT}",
        f"step-{STEPS}",
    ]  # the newest two checkpoints kept
    # It learns (see the docstring for the figures), and greedy decoding does no worse.
    warm = resolve_model_path(manifest["spec"]["model"]["path"])
    learned = answer_chance(second.dir / "checkpoints" / "export" / f"version-{STEPS}", warm)
    assert learned - answer_chance(Path(warm), warm) >= 0.03, learned
    evals = [json.loads(line) for line in (second.dir / "metrics.jsonl").read_text().splitlines()]
    at_start = next(e for e in evals if e["kind"] == "eval" and e["version"] == 0)  # the first run's
    assert summary["final_accuracy"] >= at_start["accuracy"], (at_start, summary)
    assert summary["warm_start_accuracy"] == at_start["accuracy"]  # the resumed run's summary reads it too

    # The trackers hold both runs: every step (those after the checkpoint twice), and the final
    # evaluation; W&B's offline runs share one id, so `wandb sync` makes them one run. W&B's
    # first run kept steps 1-9 of 17 when it wrote its file every 15 s (its default).
    ids = json.loads((second.dir / "tracking.json").read_text())
    import mlflow

    client = mlflow.MlflowClient(default_mlflow_uri(second.dir))
    steps = [h.step for h in client.get_metric_history(ids["mlflow"], "train/reward")]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    assert (STEPS, summary["final_accuracy"]) in [
        (h.step, h.value) for h in client.get_metric_history(ids["mlflow"], "eval/accuracy")
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(second.dir / "tensorboard"))
    events.Reload()
    assert {e.step for e in events.Scalars("train/loss")} == set(range(1, STEPS + 1))
    runs = sorted(second.dir.glob(f"wandb/offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    history = [row for run in runs for row in wandb_history(run)]
    assert len(runs) == 2 and {r["train/step"] for r in history if "train/step" in r} == set(range(1, STEPS + 1))
    assert any(r.get("eval/version") == STEPS for r in history)
