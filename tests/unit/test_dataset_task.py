"""The `dataset` task: rows read with Hugging Face `datasets` from JSONL / Parquet, prompts as
text or chat messages, TRL-style reward functions, and errors that name the row and the field."""

import asyncio
import json
import time

import pytest
from test_tasks import ScriptedPolicy  # tests/unit/test_tasks.py

from pipelinerl.tasks import DatasetTask, make_task
from pipelinerl.tiny_model import make_tokenizer

SEEN: list[dict] = []


def spy_reward(completions, prompts, completion_ids, answer, level, **kwargs):
    SEEN.append(
        {
            "completions": completions,
            "prompts": prompts,
            "completion_ids": completion_ids,
            "answer": answer,
            "level": level,
            **kwargs,
        }
    )
    return [0.5 * (c.strip() == a) + 0.5 for c, a in zip(completions, answer)]


def length_penalty(completions, **kwargs):
    return [-0.01 * len(completions[0])]


def broken_reward(completions, **kwargs):
    return ["high"]


def numpy_reward(completions, **kwargs):
    import numpy

    return [numpy.float32(1.0)]


def not_for_this_one(completions, **kwargs):
    return [None]


async def silent_judge(completions, **kwargs):
    await asyncio.sleep(3600)  # a remote judge that never answers


def stuck_reward(completions, **kwargs):
    time.sleep(1)  # a blocking call past the timeout (a thread cannot be cancelled: it ends on its own)
    return [1.0]


async def async_reward(completions, answer, **kwargs):
    await asyncio.sleep(0)
    return [float(completions[0][-1]["content"].strip() == answer[0])]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows(n):
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(n)]


def test_text_prompts_trl_reward_signature_weights_and_a_held_out_tail(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(30))
    task = make_task(
        "dataset",
        {
            "train": train,
            "test_rows": 5,
            "reward": ["test_dataset_task:spy_reward", "test_dataset_task:length_penalty"],
            "reward_weights": [1.0, 2.0],
        },
        seed=3,
    )
    assert isinstance(task, DatasetTask)
    held_out = task.test_problems(100)
    assert [p.prompt for p in held_out] == [f"{i}+{i}=" for i in range(25, 30)]
    trained = {task.train_problem(i).prompt for i in range(50)}
    assert len(trained) == 25 and not trained & {p.prompt for p in held_out}  # every row once per epoch
    assert task.train_problem(7) == make_task(
        "dataset", {"train": train, "test_rows": 5, "reward": "test_dataset_task:spy_reward"}, seed=3
    ).train_problem(7)
    tok = make_tokenizer()
    problem = held_out[0]
    SEEN.clear()
    sample = asyncio.run(task.rollout(ScriptedPolicy(tok, ["50"]), tok, problem, 8))
    assert sample.reward == pytest.approx(1.0 - 0.02 * 2) and sample.success is False  # 1.0 - 2 × 0.01 × len("50")
    (call,) = SEEN
    assert call["completions"] == ["50"] and call["prompts"] == ["25+25="] and call["answer"] == ["50"]
    assert call["level"] == [1] and call["completion_ids"][0][-1] == tok.eos_token_id


def test_chat_prompts_from_parquet_with_an_async_reward(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(6)]
    )
    pq.write_table(table, tmp_path / "train.parquet")
    pq.write_table(table.slice(0, 2), tmp_path / "test.parquet")
    task = make_task(
        "dataset",
        {
            "train": str(tmp_path / "*.parquet").replace("*", "train"),
            "test": str(tmp_path / "test.parquet"),
            "reward": "test_dataset_task:async_reward",
        },
    )
    tok = make_tokenizer()  # no chat template: the messages are joined as text
    problem = task.test_problems(10)[1]
    policy = ScriptedPolicy(tok, ["2"])
    sample = asyncio.run(task.rollout(policy, tok, problem, 8))
    assert sample.reward == 1.0 and sample.success
    assert policy.prompts[0] == tok.encode("1+1=")


@pytest.mark.parametrize(
    "params, message",
    [
        ({"reward": "test_dataset_task:spy_reward"}, "spec.task.params.train is required"),
        ({"train": "TRAIN"}, "spec.task.params.reward is required"),
        ({"train": "TRAIN", "reward": "nope"}, "spec.task.params.reward: 'nope' is not module:function"),
        ({"train": "TRAIN", "reward": "test_dataset_task:missing"}, "cannot import 'test_dataset_task:missing'"),
        (
            {"train": "no/such/*.jsonl", "reward": "test_dataset_task:spy_reward"},
            "spec.task.params.train: no file matches",
        ),
        (
            {"train": "TRAIN", "reward": "test_dataset_task:spy_reward", "prompt_field": "question"},
            "row 1: no field 'question' (columns: prompt, answer, level; set prompt_field)",
        ),
        ({"train": "TRAIN", "reward": "test_dataset_task:spy_reward", "test_rows": 40}, "40) to hold out"),
        (  # (all of train was held out, and the generators divided by zero)
            {"train": "TRAIN", "reward": "test_dataset_task:spy_reward", "test_rows": 0},
            "task.params.test_rows: must be an integer within 1",
        ),
        (
            {"train": "TRAIN", "reward": ["test_dataset_task:spy_reward"], "reward_weights": [1, 2]},
            "2 weights for 1 reward functions",
        ),
    ],
)
def test_bad_params_are_named(tmp_path, params, message):
    train = write_jsonl(tmp_path / "train.jsonl", rows(30))
    params = {k: (train if v == "TRAIN" else v) for k, v in params.items()}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_task("dataset", params)


def test_a_bad_row_and_a_bad_reward_are_named(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(5) + [{"prompt": 7, "answer": "1", "level": 0}])
    with pytest.raises(ValueError, match=r"train.jsonl row 6: field 'prompt' must be text or a list of"):
        make_task("dataset", {"train": train, "reward": "test_dataset_task:spy_reward", "test_rows": 1})
    train = write_jsonl(tmp_path / "train.jsonl", rows(5))
    task = make_task("dataset", {"train": train, "reward": "test_dataset_task:broken_reward", "test_rows": 1})
    tok = make_tokenizer()
    with pytest.raises(
        ValueError,
        match=r"reward function test_dataset_task:broken_reward returned \['high'\] "
        r"for train-4: expected a list of one finite number",
    ):
        asyncio.run(task.rollout(ScriptedPolicy(tok, ["1"]), tok, task.test_problems(1)[0], 8))


def test_a_builtin_models_tokenizer_keeps_the_spaces_of_a_prompt(tmp_path):
    """transformers' AutoTokenizer builds the Qwen2 architecture's tokenizer for a built-in model
    and drops spaces; the generator and the benchmarks load it as saved."""
    from transformers import AutoTokenizer

    from pipelinerl.tiny_model import load_tokenizer, make_model, make_tokenizer

    make_model().save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "pipelinerl-model.json").write_text('{"name": "tiny-random"}')
    text = "12 + 3 = 15"
    assert load_tokenizer(str(tmp_path)).encode(text) == make_tokenizer().encode(text)
    assert load_tokenizer(str(tmp_path)).decode(make_tokenizer().encode(text)) == text
    assert AutoTokenizer.from_pretrained(tmp_path).encode(text) != make_tokenizer().encode(text)  # the bug it avoids


@pytest.mark.parametrize("reward", ["silent_judge", "stuck_reward"])
def test_a_reward_function_that_never_returns_is_given_up_on_naming_it(reward, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(5))
    params = {"train": train, "reward": f"test_dataset_task:{reward}", "test_rows": 1, "reward_timeout_s": 0.2}
    task = make_task("dataset", params)
    tok = make_tokenizer()
    started = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=rf"reward function test_dataset_task:{reward} gave no reward for train-4 within 0.2 s "
        r"\(spec.task.params.reward_timeout_s\)",
    ):
        asyncio.run(task.rollout(ScriptedPolicy(tok, ["1"]), tok, task.test_problems(1)[0], 8))
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="spec.task.params.reward_timeout_s: must be > 0, got 0"):
        make_task("dataset", params | {"reward_timeout_s": 0})


def test_a_reward_of_none_adds_nothing_a_numpy_number_counts_and_a_cut_completion_is_never_solved(tmp_path):
    """As TRL takes them: None from a function that does not apply to a completion (it adds
    nothing to the weighted sum), a numpy number as a number. A completion cut at maxTokens keeps
    its reward (trained with it) but is never counted solved (it inflated held-out accuracy)."""
    from pipelinerl.tasks import Completion

    train = write_jsonl(tmp_path / "train.jsonl", rows(5))
    params = {"train": train, "reward": ["test_dataset_task:numpy_reward", "test_dataset_task:not_for_this_one"]}
    task = make_task("dataset", params | {"test_rows": 1})
    tok = make_tokenizer()
    problem = task.test_problems(1)[0]
    solved = asyncio.run(task.rollout(ScriptedPolicy(tok, ["1"]), tok, problem, 8))
    assert (solved.reward, solved.success) == (1.0, True)

    class Cut(ScriptedPolicy):
        async def generate(self, prompt, max_tokens, greedy=False) -> Completion:
            ids = self.tok.encode("12345678")[:max_tokens]
            return Completion(ids, [-0.1] * len(ids), [3] * len(ids), "length")

    cut = asyncio.run(task.rollout(Cut(tok, []), tok, problem, 8))
    assert (cut.reward, cut.success, cut.truncated) == (1.0, False, True)


def test_a_reward_or_task_module_that_cannot_be_imported_is_named_by_its_field(tmp_path, monkeypatch):
    """Whatever the user's module raises on import (a syntax error, a missing dependency) names the
    field, as a missing one does; a file name given for a module says what to give."""
    (tmp_path / "typo_rewards.py").write_text("def reward(completions:\n")
    (tmp_path / "needs_more.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train = write_jsonl(tmp_path / "train.jsonl", rows(5))
    for reward, said in [
        ("typo_rewards:reward", "SyntaxError"),
        ("needs_more:reward", "ModuleNotFoundError: No module named 'no_such_dependency'"),
        ("rewards.py:reward", "a module's dotted name, not a file: 'rewards'"),
    ]:
        with pytest.raises(ValueError, match=f"spec.task.params.reward: cannot import '{reward}': .*{said}"):
            make_task("dataset", {"train": train, "reward": reward, "test_rows": 1})
    with pytest.raises(ValueError, match="spec.task.name: cannot import 'typo_rewards:MyTask': SyntaxError"):
        make_task("typo_rewards:MyTask")
