import asyncio

import pytest

from pipelinerl.tasks import ArithTask, Completion, GuessTask, make_task
from pipelinerl.tiny_model import make_tokenizer


class ScriptedPolicy:
    """Plays back fixed model turns (a stand-in for the engine: this tests the task logic only)."""

    def __init__(self, tokenizer, turns: list[str], version: int = 3):
        self.tok, self.turns, self.version, self.prompts = tokenizer, list(turns), version, []

    async def generate(self, prompt, max_tokens, greedy=False) -> Completion:
        self.prompts.append(list(prompt))
        text = self.turns.pop(0)
        ids = self.tok.encode(text) + [self.tok.eos_token_id]
        return Completion(ids, [-0.1] * len(ids), [self.version] * len(ids), "stop")


def test_arith_problems_are_deterministic_and_disjoint():
    task = ArithTask(digits=3, seed=0)
    test = task.test_problems(300)
    assert test == ArithTask(digits=3, seed=0).test_problems(300)
    train = [task.train_problem(i) for i in range(2000)]
    assert train[5] == task.train_problem(5)
    test_prompts = {p.prompt for p in test}
    assert not test_prompts & {p.prompt for p in train}
    a, b = map(int, train[0].prompt[:-1].split("+"))
    assert train[0].answer == str(a + b) and 100 <= a <= 999


def test_arith_rollout_reward_and_masks():
    tok = make_tokenizer()
    task = ArithTask()
    p = task.test_problems(1)[0]
    s = asyncio.run(task.rollout(ScriptedPolicy(tok, [p.answer]), tok, p, 8))
    assert s.reward == 1.0 and s.success
    n_prompt = len(tok.encode(p.prompt))
    assert s.mask == [0] * n_prompt + [1] * (len(p.answer) + 1)
    assert s.versions[n_prompt:] == [3] * (len(p.answer) + 1)
    wrong = asyncio.run(task.rollout(ScriptedPolicy(tok, ["1"]), tok, p, 8))
    assert wrong.reward == 0.0


def test_guess_is_multi_turn_with_untrained_env_tokens():
    tok = make_tokenizer()
    task = GuessTask(max_number=99, turns=4)
    problem = task.test_problems(1)[0]
    secret = problem.answer
    low, high = (secret - 1, secret + 1) if 0 < secret < 99 else (secret, secret)
    policy = ScriptedPolicy(tok, [str(high), str(low), str(secret)] if 0 < secret < 99 else [str(secret)])
    s = asyncio.run(task.rollout(policy, tok, problem, 4))
    assert s.success
    if 0 < secret < 99:
        assert s.reward == pytest.approx(1 - 2 / 4)
        text = tok.decode(s.tokens, skip_special_tokens=True)
        assert text == f":{high}<{low}>{secret}"
        # env replies '<' and '>' are untrained; every model token (eos included) is trained
        env_positions = [i for i, t in enumerate(s.tokens) if t in tok.encode("<>")]
        assert env_positions and all(s.mask[i] == 0 and s.versions[i] == -1 for i in env_positions)
        assert sum(s.mask) == sum(len(tok.encode(str(x))) + 1 for x in (high, low, secret))
        # later turns see the whole conversation so far
        assert len(policy.prompts[2]) > len(policy.prompts[1]) > len(policy.prompts[0])


def test_guess_feedback_and_failure():
    assert GuessTask.feedback("50", 30) == "<" and GuessTask.feedback("10", 30) == ">"
    assert GuessTask.feedback("30", 30) == "=" and GuessTask.feedback("", 30) == "?"
    tok = make_tokenizer()
    task = GuessTask(turns=2)
    s = asyncio.run(task.rollout(ScriptedPolicy(tok, ["200", "201"]), tok, task.test_problems(1)[0], 4))
    assert s.reward == 0.0 and not s.success


def test_a_guess_episode_out_of_context_ends_unsolved_and_a_first_prompt_too_long_is_skipped():
    """A later turn whose conversation leaves no room for a guess within model.maxSeqLen
    (`PromptTooLong`) ends the episode, unsolved and kept (reward 0, truncated) up to its last
    guess, within model.maxSeqLen: skipped, it left the model's hardest secrets out of training
    and out of the held-out accuracy's count; kept with the reply after it, the group was refused
    as too long."""
    from pipelinerl.tasks import PromptTooLong

    class Short(ScriptedPolicy):  # model.maxSeqLen 11, as vLLM takes it (prompt and completion within)
        async def generate(self, prompt, max_tokens, greedy=False) -> Completion:
            if len(prompt) >= 11:
                raise PromptTooLong(f"a prompt of {len(prompt)} tokens leaves no room")
            return await super().generate(prompt, min(max_tokens, 11 - len(prompt)), greedy)

    tok = make_tokenizer()
    task = GuessTask(turns=4)
    problem = next(p for p in task.test_problems(20) if p.answer not in (200, 201))
    s = asyncio.run(task.rollout(Short(tok, ["200", "201", "202"]), tok, problem, 4))
    assert (s.reward, s.success, s.truncated) == (0.0, False, True)
    assert tok.decode(s.tokens, skip_special_tokens=True) == ":200<201" and sum(s.mask) == 8
    assert len(s.tokens) == len(s.mask) == len(s.versions) == len(s.logprobs) == 10 <= 11
    with pytest.raises(PromptTooLong):
        asyncio.run(task.rollout(Short(tok, []), tok, problem.__class__(id="x", prompt=":" * 11, answer=1), 4))


def test_make_task_errors():
    assert isinstance(make_task("guess", {"turns": 3}), GuessTask)
    assert isinstance(make_task("pipelinerl.tasks.arith:ArithTask"), ArithTask)
    with pytest.raises(ValueError, match="spec.task.name: unknown task 'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match="spec.task.params"):
        make_task("arith", {"digitz": 3})


def test_math_task_from_jsonl(tmp_path):
    from pipelinerl.tasks.math import MathTask, final_number

    assert final_number("so 3 + 4 = 7 #### 1,234") == "1234"
    assert final_number("the result is 12.0") == "12" and final_number("no digits") is None
    # Compared as values: the same number written otherwise is the same answer, another is not.
    for same in [("18.00", "18"), ("-0", "0"), ("007", "7"), ("#### .5", "0.50"), ("#### 3/4", "0.75")]:
        assert final_number(same[0]) == final_number(same[1]), same
    for other in [("#### 3/4", "3"), ("#### .5", "5"), ("1,2,3", "123"), ("12,345", "12")]:
        assert final_number(other[0]) != final_number(other[1]), other
    assert final_number("#### 1/0") is None and final_number("1" * 5000) is None  # (Fraction raised on both)
    assert final_number("1.5/2") == "2"  # (a decimal over a denominator raised too)
    data = tmp_path / "train.jsonl"
    rows = ['{"question": "2+3?", "answer": "2+3=5 #### 5"}', '{"question": "7*6?", "answer": "42"}']
    data.write_text("\n".join([*rows, '{"question": "1+1?", "answer": "#### 2"}']) + "\n")
    task = make_task("math", {"train_file": str(data), "test_rows": 1}, seed=1)
    assert isinstance(task, MathTask)
    assert {task.train_problem(i).answer for i in range(2)} == {"5", "42"}  # one epoch covers all
    assert task.train_problem(7) == MathTask(train_file=str(data), test_rows=1, seed=1).train_problem(7)
    # Without a test file its last lines are held out, never trained on (they were trained on too).
    assert [p.prompt for p in task.test_problems(5)] == ["1+1?"]
    assert "1+1?" not in {task.train_problem(i).prompt for i in range(20)}
    with pytest.raises(ValueError, match="3 problems, not more than test_rows \\(100\\) to hold out"):
        make_task("math", {"train_file": str(data)})
    with pytest.raises(ValueError, match="task.params.test_rows: must be an integer within 1"):
        make_task("math", {"train_file": str(data), "test_rows": 0})
    tok = make_tokenizer()
    p = task.test_problems(1)[0]
    good = asyncio.run(task.rollout(ScriptedPolicy(tok, [f"12+3=15 #### {p.answer}"]), tok, p, 32))
    bad = asyncio.run(task.rollout(ScriptedPolicy(tok, ["#### 99"]), tok, p, 32))
    assert good.reward == 1.0 and bad.reward == 0.0
    data.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="line 1"):
        make_task("math", {"train_file": str(data)})
    data.write_text('{"question": "x", "answer": "none"}\n')
    with pytest.raises(ValueError, match="line 1: the answer 'none' holds no number"):
        make_task("math", {"train_file": str(data)})


def test_arith_without_carry_out_keeps_the_answer_length():
    task = ArithTask(digits=3, carry_out=False, seed=0)
    problems = task.test_problems(300) + [task.train_problem(i) for i in range(300)]
    assert all(len(p.answer) == 3 for p in problems)
    # The default draws carry-out sums too (about half of all pairs).
    assert sum(len(p.answer) == 4 for p in ArithTask(digits=3, seed=0).test_problems(300)) > 100


def test_the_spec_knows_every_builtin_task() -> None:
    from pipelinerl.spec import TASK_NAMES
    from pipelinerl.tasks import BUILTIN

    assert set(TASK_NAMES) == set(BUILTIN)  # validate and the CRD accept exactly these names


def test_chain_problems_are_worked_step_by_step_with_a_long_tail():
    from pipelinerl.tasks.chain import ChainTask, worked

    assert worked(37, 6, 4) == "3:43 2:49 1:55 0:61"
    task = ChainTask(max_steps=12, seed=0)
    assert task.test_problems(200) == ChainTask(max_steps=12, seed=0).test_problems(200)
    train = [task.train_problem(i) for i in range(3000)]
    assert train[7] == task.train_problem(7)
    assert not {p.prompt for p in task.test_problems(500)} & {p.prompt for p in train}
    p = train[0]
    start, rest = p.prompt[:-1].split("+")
    addend, steps = map(int, rest.split("*"))
    assert p.answer == worked(int(start), addend, steps) and p.extra["steps"] == steps
    assert p.answer.endswith(f"0:{int(start) + addend * steps}")
    counts = [sum(q.extra["steps"] == k for q in train) for k in range(1, 13)]
    assert counts[0] > 2 * counts[3] > 0 and counts[11] > 0  # P(k) ∝ 1/k: short ones common, long ones present
    # Completion lengths (answer + EOS) within a step of 16 prompts differ by 10x or more, mostly.
    lengths = [len(q.answer) + 1 for q in train]
    spreads = [max(lengths[i : i + 16]) / min(lengths[i : i + 16]) for i in range(0, 3000, 16)]
    assert sorted(spreads)[len(spreads) // 2] >= 10
    assert all(len(q.answer) + 1 <= 96 for q in train)  # within the example job's maxTokens
    with pytest.raises(ValueError, match="max_steps"):
        ChainTask(max_steps=0)


def test_chain_rollout_rewards_only_the_whole_worked_solution():
    from pipelinerl.tasks.chain import ChainTask

    tok = make_tokenizer()
    task = ChainTask()
    p = next(q for q in task.test_problems(50) if q.extra["steps"] >= 3)
    right = asyncio.run(task.rollout(ScriptedPolicy(tok, [p.answer]), tok, p, 96))
    assert right.reward == 1.0 and right.success and sum(right.mask) == len(p.answer) + 1
    last = p.answer.rsplit(" ", 1)[1]
    shortcut = asyncio.run(task.rollout(ScriptedPolicy(tok, [last]), tok, p, 96))  # the final total alone
    one_step_off = p.answer.replace(" ", "  ", 1)
    assert shortcut.reward == 0.0
    assert asyncio.run(task.rollout(ScriptedPolicy(tok, [one_step_off]), tok, p, 96)).reward == 0.0


def test_batch_loss_in_length_buckets_is_the_same_loss():
    import torch

    from pipelinerl.tasks.chain import ChainTask
    from pipelinerl.tiny_model import batch_loss, make_model

    torch.manual_seed(0)
    tok, model = make_tokenizer(), make_model()
    batch = [ChainTask().train_problem(i) for i in range(24)]
    whole, bucketed = batch_loss(model, tok, batch), batch_loss(model, tok, batch, buckets=4)
    assert bucketed.item() == pytest.approx(whole.item(), rel=1e-5)
    grads = []
    for loss in (whole, bucketed):
        model.zero_grad()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_greedy_accuracy_counts_answers_that_stop_and_batches_by_prompt_length():
    import torch

    from pipelinerl.tasks.base import Problem
    from pipelinerl.tiny_model import greedy_accuracy, greedy_correct

    tok = make_tokenizer()
    eos = tok.eos_token_id
    replies = {"1+2=": "3", "10+20=": "30", "9+9=": "18"}  # the last one never stops

    class Scripted:
        calls: list[int] = []

        def generate(self, input_ids, max_new_tokens, **_):
            self.calls.append(input_ids.shape[1])
            rows = []
            for ids in input_ids.tolist():
                prompt = tok.decode(ids)
                new = tok.encode(replies[prompt]) + ([eos] if prompt != "9+9=" else [])
                rows.append(ids + (new + [tok.pad_token_id] * max_new_tokens)[:max_new_tokens])
            return torch.tensor(rows)

    model = Scripted()
    problems = [
        Problem("a", "1+2=", "3"),
        Problem("b", "10+20=", "30"),
        Problem("c", "9+9=", "18"),
        Problem("d", "1+2=", "4"),
    ]
    assert greedy_accuracy(model, tok, problems, max_new_tokens=4) == pytest.approx(2 / 4)
    assert sorted(model.calls) == [4, 6]  # one generate per prompt length, none padded
    # Per problem in the problems' order, whatever the batching: what the benchmarks resample.
    assert greedy_correct(model, tok, problems, max_new_tokens=4) == [True, True, False, False]


def test_answer_probability_is_the_chance_that_sampling_writes_the_answer_then_stops():
    """Against the chain rule taken one token at a time, each problem alone; the batch pads
    problems of different lengths on the right without changing any of them."""
    import torch

    from pipelinerl.tasks.base import Problem
    from pipelinerl.tiny_model import answer_probability, make_model

    tok, model = make_tokenizer(), make_model(seed=3).eval()
    problems = [Problem("a", "1+2=", "3"), Problem("b", "310+205=", "515"), Problem("c", "9+9=", "18")]
    expected = []
    for p in problems:
        ids, chance = tok.encode(p.prompt), 1.0
        for token in tok.encode(p.answer) + [tok.eos_token_id]:
            with torch.no_grad():
                chance *= float(torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)[token])
            ids = ids + [token]
        expected.append(chance)
    assert answer_probability(model, tok, problems) == pytest.approx(expected, rel=1e-4)
    assert answer_probability(model, tok, problems[1:2]) == pytest.approx(expected[1:2], rel=1e-4)
    assert 0 < min(expected) and max(expected) < 1


def test_a_groups_prompt_is_tokenized_once_for_all_its_attempts():
    """The generator tokenizes a prompt per request; a group's attempts share it, so each
    tokenizer remembers its last prompts (a per-request cost on short completions)."""
    from pipelinerl.tasks import base

    class Counting:
        eos_token_id = 0

        def __init__(self):
            self.calls = 0

        def encode(self, text, add_special_tokens=True):
            self.calls += 1
            return [ord(c) for c in text]

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            self.calls += 1
            return [len(m["content"]) for m in messages] + [99]

    tok = Counting()
    first = base.prompt_ids(tok, "12+34=", chat_template=False)
    first.append(-1)  # the caller's list is its own
    assert base.prompt_ids(tok, "12+34=", chat_template=False) == [ord(c) for c in "12+34="] and tok.calls == 1
    assert base.prompt_ids(tok, "12+34=", chat_template=True) == [6, 99] and tok.calls == 2  # another form
    chat = [{"role": "user", "content": "hi"}]
    assert base.prompt_ids(tok, chat, chat_template=True) == base.prompt_ids(tok, list(chat), True) == [2, 99]
    assert tok.calls == 3
    other = Counting()  # each tokenizer its own
    assert base.prompt_ids(other, "12+34=", chat_template=False) and other.calls == 1
    for i in range(base.PROMPT_CACHE_SIZE + 1):  # bounded: the oldest goes first
        base.prompt_ids(tok, f"p{i}", chat_template=False)
    calls = tok.calls
    base.prompt_ids(tok, "12+34=", chat_template=False)
    assert tok.calls == calls + 1
