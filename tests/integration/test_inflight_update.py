"""In-flight weight updates of a live vLLM engine (the project's `Engine`), checked against
Hugging Face: a trainer stand-in in a spawned process broadcasts weights over a real gloo
`WeightGroup`; the engine receives them through its worker extension mid-generation."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from pipelinerl.ports import free_port
from pipelinerl.tasks import PromptTooLong
from pipelinerl_generator.engine import EngineStuck, WeightsKept, WorkersOutOfStep
from pipelinerl_generator.weight_receiver import WeightReceiverExtension

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

HOST = "127.0.0.1"
SYNC_TIMEOUT_S = 60.0
SEEDS = {"A": 1, "B": 2}
PROMPTS = ["12+34=", "7*8=", "99-5=", "3<4?"]
N_GREEDY = 24
LONG_TOKENS = 200


# --- models ---------------------------------------------------------------------------------


def save_model(path: Path, seed: int) -> str:
    """`make_model(seed)` with sharper logits and no way to emit eos (so requests run to max_tokens)."""
    from pipelinerl.tiny_model import make_model, make_tokenizer

    tok, model = make_tokenizer(), make_model(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(10.0)  # std 0.2: diverse greedy text, top-2 logit gaps >> float32 noise
        # Tied head: a zero eos row gives eos logit 0 while the best token's logit is > 0.
        model.model.embed_tokens.weight[tok.eos_token_id] = 0.0
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def load_hf(path: str):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """logprob of tokens[i] given prompt + tokens[:i], in one forward pass."""
    ids = torch.tensor([prompt + tokens])
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return lp[pos, torch.tensor(tokens)]


# --- trainer stand-in (spawned: module-level target) -------------------------------------------


def _sender_main(paths: dict[str, str], port: int, cmd_q, res_q) -> None:
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from pipelinerl.weight_group import WeightGroup, open_store
    from pipelinerl.weight_snapshot import Snapshot

    state = {name: load_file(f"{p}/model.safetensors") for name, p in paths.items()}
    group = store = None
    while True:
        cmd, *args = cmd_q.get()
        try:
            if cmd == "init":  # a new epoch, named args[0] (default "g"), of args[1] ranks (default 2)
                if group is not None:
                    group.close()
                store = store or open_store(HOST, port, True, SYNC_TIMEOUT_S)
                epoch, world = (list(args) + ["g", 2][len(args) :])[:2]  # its name, its size
                group = WeightGroup.form(store, epoch, world, SYNC_TIMEOUT_S)
                res_q.put(("ok", None))
            elif cmd == "send":
                which, buckets = args
                snapshot = Snapshot(buckets, group.device)
                for i in range(len(buckets)):
                    snapshot.pack(i, state[which])
                group.broadcast(snapshot)
                res_q.put(("ok", None))
            elif cmd == "close":
                if group is not None:
                    group.close()
                return
        except BaseException as e:  # report, never leave the test waiting
            res_q.put(("err", repr(e)))


async def reply(res_q):
    status, val = await asyncio.to_thread(res_q.get, True, SYNC_TIMEOUT_S + 30)
    if status != "ok":
        raise RuntimeError(f"trainer stand-in failed: {val}")
    return val


@dataclass
class Rig:
    engine: object
    tokenizer: object
    hf: dict
    buckets: list
    cmd_q: object
    res_q: object
    port: int
    sender: object
    paths: dict[str, str]
    in_place: bool = True  # the receiver's loading path under test
    staged: bool = True  # transferred and loaded beside generation, swapped in a short pause
    current: str = "A"  # which weights the engine holds

    async def update(self, which: str):
        version = self.engine.version + 1
        self.cmd_q.put(("send", which, self.buckets))
        stats = await self.engine.update_weights(version, self.buckets)
        await reply(self.res_q)
        self.current = which
        return stats


# vLLM resolves the extension by qualified name in this process (single-process engine on CPU).
class Probe(WeightReceiverExtension):
    """The project's extension, plus probes of the loading path the last update took, and a
    switch onto its other path, vLLM's layerwise reload (taken for quantized models)."""

    _probe_reload = False
    _probe_last_in_place: bool | None = None
    _probe_last_staged: bool | None = None

    def probe_force_reload(self, on: bool) -> None:
        self._probe_reload = on

    def _pipelinerl_load_blockers(self, model) -> list[str]:
        return ["forced by the test"] if self._probe_reload else super()._pipelinerl_load_blockers(model)

    def receive_weights(self, buckets):
        self._probe_last_in_place = self._probe_last_staged = False
        return super().receive_weights(buckets)

    def stage_weights(self, buckets):
        self._probe_last_staged = started = super().stage_weights(buckets)
        return started

    def _pipelinerl_load_in_place(self, model, packed, weights) -> None:
        self._probe_last_in_place = True
        super()._pipelinerl_load_in_place(model, packed, weights)

    def probe_loaded_in_place(self) -> bool | None:
        return self._probe_last_in_place

    def probe_staged(self) -> bool | None:
        return self._probe_last_staged

    def probe_staging_alive(self) -> bool:
        return self._pipelinerl_transfer is not None and self._pipelinerl_transfer.thread.is_alive()

    def probe_block(self, seconds: float) -> None:  # a call that holds the engine core's thread
        time.sleep(seconds)


# (the layerwise reload, weightSync.staged): staged in-place loading (the default), in-place
# loading inside the pause, and the layerwise reload (quantized models), which cannot stage and
# falls back. The two in-place paths share an engine (each start costs ~20 s of the suite); the
# reload gets its own: an engine takes one of the two for its life (the model is quantized or not),
# and neither works after the other has loaded.
PATHS = {"staged": (False, True), "in_pause": (False, False), "reload": (True, True)}


def models_and_job(root: Path, name: str):
    """Models A and B saved under `root`, a job generating with A, and the bucket plan of its
    weights (several buckets)."""
    from safetensors.torch import load_file

    from pipelinerl.spec import parse_job
    from pipelinerl.weight_group import dtype_name, plan_buckets

    paths = {model: save_model(root / model, seed) for model, seed in SEEDS.items()}
    job = parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": name},
            "spec": {
                "model": {"path": paths["A"], "maxSeqLen": 256, "dtype": "float32"},
                "generator": {"sampling": {"maxTokens": LONG_TOKENS}},
                "weightSync": {"backend": "gloo", "bucketMb": 1, "timeoutSeconds": SYNC_TIMEOUT_S},
            },
        }
    )
    weights = load_file(f"{paths['A']}/model.safetensors")
    bucket_bytes = job.spec.weight_sync.bucket_mb << 20
    buckets = plan_buckets([(n, list(t.shape), dtype_name(t.dtype)) for n, t in weights.items()], bucket_bytes)
    assert len(buckets) > 1  # exercise several buckets
    return paths, job, buckets


def start_sender(paths: dict[str, str]):
    """The trainer stand-in, spawned: its command and reply queues, its store's port, the process."""
    ctx = mp.get_context("spawn")
    cmd_q, res_q, port = ctx.Queue(), ctx.Queue(), free_port()
    sender = ctx.Process(target=_sender_main, args=(paths, port, cmd_q, res_q), daemon=True)
    sender.start()
    return cmd_q, res_q, port, sender


def stop(cmd_q, engine, sender) -> None:
    cmd_q.put(("close",))
    engine.shutdown()
    sender.join(10)
    if sender.is_alive():
        sender.kill()


async def start_rig(root: Path, reload: bool) -> Rig:
    from pipelinerl.tiny_model import make_tokenizer
    from pipelinerl_generator.engine import Engine

    paths, job, buckets = models_and_job(root, "inflight")
    # The probe replaces PipelineRL's extension, which validation refuses from a manifest.
    job.spec.generator.engine_args["worker_extension_cls"] = f"{__name__}.{Probe.__name__}"
    cmd_q, res_q, port, sender = start_sender(paths)
    engine = Engine(job, paths["A"])
    rig = Rig(engine, make_tokenizer(), {}, buckets, cmd_q, res_q, port, sender, paths)
    try:
        await engine.start(0)
        await engine.llm.collective_rpc("probe_force_reload", args=(reload,))  # before any update
        cmd_q.put(("init",))
        await engine.join_weight_group(HOST, port, "g", 1, 2, job.spec.weight_sync.timeout_seconds)
        await reply(res_q)
        rig.hf = {n: load_hf(p) for n, p in paths.items()}
    except BaseException:
        stop_rig(rig)
        raise
    return rig


def stop_rig(rig: Rig) -> None:
    stop(rig.cmd_q, rig.engine, rig.sender)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tmp_path_factory):
    """The rig for a loading path (reload or in place), started when first asked for; one at a time."""
    running: dict[bool, Rig] = {}

    async def rig_for(reload: bool) -> Rig:
        if reload not in running:
            for other in running.values():
                stop_rig(other)
            running.clear()
            running[reload] = await start_rig(tmp_path_factory.mktemp("inflight"), reload)
        return running[reload]

    try:
        yield rig_for
    finally:
        for rig in running.values():
            stop_rig(rig)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(PATHS))
async def rig(request, engines):
    """An engine on one loading path: the tests run path by path, in PATHS order."""
    reload, staged = PATHS[request.param]
    rig = await engines(reload)
    await rig.engine.choose_staged(staged)
    rig.in_place, rig.staged = not reload, staged and not reload
    return rig


async def wait_for_output_tokens(engine, n: int, timeout_s: float = 120.0) -> int:
    """Block until the (single) running request has produced >= n tokens; returns the count seen."""
    states = engine.llm.output_processor.request_states
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counts = [s.detokenizer.num_output_tokens() for s in list(states.values())]
        if counts and max(counts) >= n:
            return max(counts)
        await asyncio.sleep(0.005)
    raise AssertionError(f"no request reached {n} output tokens in {timeout_s}s")


# --- tests ----------------------------------------------------------------------------------


async def test_update_switches_greedy_output_from_model_a_to_model_b(rig):
    engine, tok = rig.engine, rig.tokenizer
    if rig.current != "A":  # only when run out of order; normally A is what vLLM loaded from disk
        await rig.update("A")
    # Short prompts plus one longer than a KV block (128 on CPU): a prefix-cache hit on KV
    # computed by the old weights would show up as output != model B.
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode(("1+2=3 " * 30)[:140])]
    ref = {n: [hf_greedy(rig.hf[n], p, N_GREEDY) for p in prompts] for n in ("A", "B")}
    assert all(a != b for a, b in zip(ref["A"], ref["B"])), "models A and B must be distinguishable"

    v_before = engine.version
    before = await asyncio.gather(*(engine.generate(p, N_GREEDY, greedy=True) for p in prompts))
    assert [c.tokens for c in before] == ref["A"]
    assert all(c.versions == [v_before] * N_GREEDY and c.finish_reason == "length" for c in before)

    stats = await rig.update("B")
    assert stats.version == engine.version == v_before + 1
    assert stats.running_requests == 0
    assert await engine.llm.collective_rpc("probe_loaded_in_place") == [rig.in_place]
    assert not stats.staged  # nothing was running: loaded inside the pause
    assert 0 < stats.pause_seconds <= stats.seconds

    after = await asyncio.gather(*(engine.generate(p, N_GREEDY, greedy=True) for p in prompts))
    assert [c.tokens for c in after] == ref["B"]
    assert all(c.versions == [stats.version] * N_GREEDY for c in after)
    for p, c in zip(prompts, after):  # sampling logprobs are model B's too
        torch.testing.assert_close(torch.tensor(c.logprobs), hf_logprobs(rig.hf["B"], p, c.tokens), atol=1e-4, rtol=0)


async def test_request_spanning_an_update_mixes_versions(rig):
    engine, tok = rig.engine, rig.tokenizer
    if rig.current != "A":
        await rig.update("A")
    v_old = engine.version
    prompt = tok.encode(PROMPTS[0])
    ref_a = hf_greedy(rig.hf["A"], prompt, LONG_TOKENS)

    task = asyncio.create_task(engine.generate(prompt, LONG_TOKENS, greedy=True))
    seen = await wait_for_output_tokens(engine, 10)
    stats = await rig.update("B")
    c = await task
    v_new = stats.version

    assert stats.running_requests == 1  # the update really happened mid-request
    assert stats.staged == rig.staged and await engine.llm.collective_rpc("probe_staged") == [rig.staged]
    if rig.staged:
        assert stats.pause_seconds < stats.seconds
    assert len(c.tokens) == len(c.versions) == len(c.logprobs) == LONG_TOKENS
    assert c.finish_reason == "length"
    assert all(a <= b for a, b in zip(c.versions, c.versions[1:])), "versions must be non-decreasing"
    assert set(c.versions) == {v_old, v_new}
    n_old = c.versions.count(v_old)
    assert seen <= n_old < LONG_TOKENS

    # Old-version tokens: exactly model A's greedy text, with model A's logprobs.
    assert c.tokens[:n_old] == ref_a[:n_old]
    lp_a = hf_logprobs(rig.hf["A"], prompt, c.tokens)
    got = torch.tensor(c.logprobs)
    torch.testing.assert_close(got[:n_old], lp_a[:n_old], atol=1e-4, rtol=0)
    # New-version tokens were sampled by other weights: model A does not explain them.
    assert (got[n_old:] - lp_a[n_old:]).abs().max() > 1e-2


async def test_a_request_made_during_an_updates_pause_runs_on_the_new_weights_alone(rig):
    """Its prompt's KV cache is the new weights' too: it waits for the pause to end and is salted
    with the new version. (Made with the old version's salt, its prompt's full blocks came from
    the prefix cache that an earlier request filled under model A.)"""
    if not rig.in_place or rig.staged:
        pytest.skip("one path suffices: nothing runs, so the pause lasts the whole transfer")
    engine = rig.engine
    if rig.current != "A":
        await rig.update("A")
    prompt = (rig.tokenizer.encode(PROMPTS[0]) * 40)[:140]  # more than a block (128 tokens on CPU)
    await engine.generate(prompt, 8, greedy=True)  # its blocks cached, salted with A's version
    version = engine.version + 1
    update = asyncio.create_task(engine.update_weights(version, rig.buckets))  # paused, waiting to receive
    await asyncio.sleep(1.0)
    request = asyncio.create_task(engine.generate(prompt, 8, greedy=True))
    await asyncio.sleep(1.0)
    rig.cmd_q.put(("send", "B", rig.buckets))
    await update
    await reply(rig.res_q)
    rig.current = "B"
    c = await request
    assert set(c.versions) == {version}
    assert c.tokens == hf_greedy(rig.hf["B"], prompt, 8)


async def test_updates_in_flight_leave_exactly_the_new_weights_live(rig):
    """Update after update with a request running (staged on the default path, as in pipeline
    mode): each time, a new request is exactly the new model's, text and sampling logprobs, so
    no tensor, copy or cache of an older version survives the swap."""
    engine, tok = rig.engine, rig.tokenizer
    prompt = tok.encode(PROMPTS[2])
    # On a GPU, CUDA graphs replay the addresses they captured: the live weights must keep their
    # storage through every update (on CPU, packed linears get their weight back at the first
    # load, so the addresses are read after one).
    await rig.update(rig.current)
    storage = await engine.llm.collective_rpc("probe_live_storage")
    for which in ("B", "A", "B") if rig.current == "A" else ("A", "B", "A"):
        running = asyncio.create_task(engine.generate(tok.encode(PROMPTS[3]), LONG_TOKENS, greedy=True))
        await wait_for_output_tokens(engine, 5)
        stats = await rig.update(which)
        assert stats.running_requests == 1 and stats.staged == rig.staged
        fresh = await engine.generate(prompt, N_GREEDY, greedy=True)
        assert fresh.tokens == hf_greedy(rig.hf[which], prompt, N_GREEDY), f"after the update to {which}"
        assert fresh.versions == [stats.version] * N_GREEDY
        torch.testing.assert_close(
            torch.tensor(fresh.logprobs), hf_logprobs(rig.hf[which], prompt, fresh.tokens), atol=1e-4, rtol=0
        )
        await running
        assert await engine.llm.collective_rpc("probe_live_storage") == storage, "a live weight moved"


@pytest.mark.parametrize(
    "dropped, weight",
    [
        ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj"),
        # One shard of a stacked parameter: vLLM counts qkv_proj as loaded at its first shard.
        ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj"),
    ],
    ids=["a-whole-weight", "a-shard-of-qkv"],
)
async def test_update_that_misses_a_weight_fails_naming_it(rig, dropped, weight):
    """On every loading path an update whose tensors leave part of a weight unwritten fails,
    naming it: loaded in place, that part would keep the previous version's values; reloaded, it
    would be uninitialised memory, which vLLM processes without a word."""
    from pipelinerl.weight_group import plan_buckets

    engine = rig.engine
    tensors = [(t["name"], t["shape"], b["dtype"]) for b in rig.buckets for t in b["tensors"]]
    assert dropped in [t[0] for t in tensors]
    partial = plan_buckets([t for t in tensors if t[0] != dropped], 1 << 20)
    rig.cmd_q.put(("send", "B", partial))
    version, prompt = engine.version, rig.tokenizer.encode(PROMPTS[1])
    running = asyncio.create_task(engine.generate(prompt, LONG_TOKENS, greedy=True))  # staged if it can be
    await wait_for_output_tokens(engine, 10)
    with pytest.raises(Exception, match=rf"did not cover 1 weights, e\.g\. {weight}\b") as failed:
        await engine.update_weights(version + 1, partial)
    # A staged failure keeps the live weights: the generator generates on (else it must stop).
    assert isinstance(failed.value, WeightsKept) == rig.staged
    await reply(rig.res_q)
    assert engine.version == version
    if rig.staged:  # the failed update loaded into the second copy only: the live weights are intact
        c = await running
        assert c.tokens == hf_greedy(rig.hf[rig.current], prompt, LONG_TOKENS)
        assert c.versions == [version] * LONG_TOKENS
    else:  # half-loaded, labelled as before: the engine stays paused, no token is sampled from them
        seen = await wait_for_output_tokens(engine, 10)
        await asyncio.sleep(1.0)
        assert await wait_for_output_tokens(engine, 10) == seen and not running.done()
    await rig.update("A")  # a full update repairs the engine (and resumes it)
    if not rig.staged:
        c = await running
        assert set(c.versions[:seen]) == {version} and set(c.versions[seen:]) == {engine.version}
    c = await engine.generate(prompt, N_GREEDY, greedy=True)
    assert c.tokens == hf_greedy(rig.hf["A"], prompt, N_GREEDY)


async def test_an_update_given_up_on_leaves_the_next_epoch_free_to_stage(rig):
    """The trainer goes silent mid-update: the generator gives up at its deadline (WeightsKept)
    while the transfer still waits on the group, generates on, joins the next epoch, and the
    next update stages and lands as usual."""
    if not rig.staged:
        pytest.skip("only a staged update runs beside generation")
    engine, sync = rig.engine, rig.engine.job.spec.weight_sync
    version, prompt = engine.version, rig.tokenizer.encode(PROMPTS[2])
    running = asyncio.create_task(engine.generate(prompt, LONG_TOKENS, greedy=True))
    await wait_for_output_tokens(engine, 10)
    patience, sync.timeout_seconds = sync.timeout_seconds, 2.0  # the engine's deadline, not the group's
    try:
        with pytest.raises(WeightsKept, match="not received and loaded within"):
            await engine.update_weights(version + 1, rig.buckets)  # nothing is sent
    finally:
        sync.timeout_seconds = patience
    assert engine.version == version
    assert await engine.llm.collective_rpc("probe_staging_alive") == [True]  # still waiting on the group
    epoch = f"g-{time.monotonic_ns()}"
    rig.cmd_q.put(("init", epoch))
    await engine.join_weight_group(HOST, rig.port, epoch, 1, 2, sync.timeout_seconds)
    await reply(rig.res_q)
    assert await engine.llm.collective_rpc("probe_staging_alive") == [False]
    await running
    running = asyncio.create_task(engine.generate(prompt, LONG_TOKENS, greedy=True))
    await wait_for_output_tokens(engine, 10)
    stats = await rig.update("B" if rig.current == "A" else "A")
    assert stats.staged and engine.version == version + 1
    await running
    c = await engine.generate(prompt, N_GREEDY, greedy=True)
    assert c.tokens == hf_greedy(rig.hf[rig.current], prompt, N_GREEDY)


async def test_an_update_whose_first_weights_never_come_keeps_the_engine_whole(rig):
    """Inside the pause (in place, or vLLM's layerwise reload), an update whose first bucket never
    comes keeps the live weights, and the engine generates on with them. vLLM's reload swaps every
    layer's tensors for meta ones as soon as it is called (`initialize_layerwise_reload`), so it
    is called only once the first weights are here."""
    if rig.staged:
        pytest.skip("a staged update that fails touches the staging copy only (above)")
    engine, sync = rig.engine, rig.engine.job.spec.weight_sync

    async def join(timeout_s: float) -> None:
        epoch = f"g-{time.monotonic_ns()}"
        rig.cmd_q.put(("init", epoch))
        await engine.join_weight_group(HOST, rig.port, epoch, 1, 2, timeout_s)
        await reply(rig.res_q)

    version, prompt = engine.version, rig.tokenizer.encode(PROMPTS[3])
    await join(3.0)  # the group's wait for a bucket
    try:
        with pytest.raises(WeightsKept, match=f"update to version {version + 1} failed, generating on"):
            await engine.update_weights(version + 1, rig.buckets)  # nothing is sent
        assert engine.version == version
        c = await engine.generate(prompt, N_GREEDY, greedy=True)
        assert c.tokens == hf_greedy(rig.hf[rig.current], prompt, N_GREEDY)
    finally:
        await join(sync.timeout_seconds)


async def test_a_join_waits_for_its_epochs_members_while_the_engine_generates_on(engines):
    """Joining an epoch waits for its other members, up to the trainer's join window where one is
    late, on the workers' threads: requests go on decoding meanwhile at the engine's own pace
    (inside `collective_rpc` the engine took no step), and the group joined
    carries the next update."""
    rig = await engines(False)
    engine, sync = rig.engine, rig.engine.job.spec.weight_sync
    prompt = rig.tokenizer.encode(PROMPTS[1])
    stop, window_s = asyncio.Event(), 2.0

    async def generate_on(max_tokens: int) -> None:
        while not stop.is_set():
            await engine.generate(prompt, max_tokens)

    def decoded() -> int:  # tokens of the requests completed, and of those running
        running = list(engine.llm.output_processor.request_states.values())
        return engine.tokens_generated + sum(s.detokenizer.num_output_tokens() for s in running)

    async def completed_in(seconds: float) -> int:
        before = decoded()
        await asyncio.sleep(seconds)
        return decoded() - before

    # Requests of several lengths: they do not all end at once (an ended one's tokens are counted
    # only once the caller has its output: a moment, while one of every length may be there).
    streams = [asyncio.create_task(generate_on(n)) for n in range(20, LONG_TOKENS, 30)]
    epoch = f"g-{time.monotonic_ns()}"
    joining = None
    try:
        await wait_for_output_tokens(engine, 10)
        alone = await completed_in(window_s)
        joining = asyncio.create_task(engine.join_weight_group(HOST, rig.port, epoch, 1, 2, sync.timeout_seconds))
        await asyncio.sleep(0.5)  # the worker said it is joining: it waits for the trainer's `go`
        joined = await completed_in(window_s)
        assert not joining.done(), joining.exception()
        # a blocked engine decodes nothing here; the bound leaves room for a loaded machine's pace
        assert joined >= alone / 4 > 0, f"{joined} tokens decoded while the join waited, {alone} before"
        rig.cmd_q.put(("init", epoch))  # the trainer forms the epoch: `go`
        await joining
        await reply(rig.res_q)
        stats = await rig.update("B" if rig.current == "A" else "A")
    finally:
        stop.set()
        if joining is not None:
            joining.cancel()
        await asyncio.gather(*streams)
    assert engine.version == stats.version and stats.running_requests > 0
    c = await engine.generate(prompt, N_GREEDY, greedy=True)
    assert c.tokens == hf_greedy(rig.hf[rig.current], prompt, N_GREEDY)


async def test_a_prompt_that_leaves_no_room_in_the_context_is_refused_and_the_engine_goes_on(engines):
    """`prompt_fit` measures a sample of a task's prompts: a longer one met later is refused
    (`PromptTooLong`, which the generator skips: the problem is not trained), where vLLM's own
    refusal failed the group and stopped the generator."""
    rig = await engines(False)
    engine = rig.engine
    with pytest.raises(PromptTooLong, match="256 tokens leaves no room"):
        await engine.generate([5] * engine.job.spec.model.max_seq_len, 4)
    prompt = rig.tokenizer.encode(PROMPTS[0])
    c = await engine.generate(prompt, N_GREEDY, greedy=True)
    assert c.tokens == hf_greedy(rig.hf[rig.current], prompt, N_GREEDY)


async def test_sampling_logprobs_at_a_temperature_are_the_trainers_own(engines):
    """At temperature 0.7 the log-prob vLLM reports for each sampled token is the one the trainer
    computes for it with the same weights (its packed forward and fused head, logits / T): on-policy
    importance ratios are 1 and the ESS of the samples is 1. With vLLM's default logprobs mode
    (before the temperature) the ratios differ from 1 by tens of percent."""
    from pipelinerl_trainer.loss import effective_sample_size
    from pipelinerl_trainer.model import load_model
    from pipelinerl_trainer.packed_attention import Packing

    rig = await engines(False)
    engine, tok = rig.engine, rig.tokenizer
    temperature, before = 0.7, engine.sampling
    engine.sampling = before.model_copy(update={"temperature": temperature})
    try:
        prompts = [tok.encode(p) for p in PROMPTS]
        completions = await asyncio.gather(*(engine.generate(p, N_GREEDY) for p in prompts for _ in range(4)))
    finally:
        engine.sampling = before
    trainer_model = load_model(str(rig.paths[rig.current])).eval()
    ratios = []
    with torch.no_grad():
        for p, c in zip([p for p in prompts for _ in range(4)], completions):
            ids = torch.tensor([p + c.tokens])
            lp, _ = trainer_model(input_ids=ids, packing=Packing.of([ids.shape[1]]), temperature=temperature)
            ratios.append(torch.exp(lp[len(p) :] - torch.tensor(c.logprobs)))
    r = torch.cat(ratios).double()
    assert (r - 1).abs().max() < 1e-3, f"on-policy ratios off by up to {(r - 1).abs().max():.3g}"
    assert effective_sample_size(r.sum().item(), (r * r).sum().item(), r.numel()) > 0.9999


async def test_the_engine_computes_its_lm_head_in_fp32_over_bf16_weights(tiny_qwen2):
    """The rig's engines run in float32, where the head's dtype is the model's: a bf16 job's
    engine is configured (not started) to compute its LM head in fp32 as the trainer does, with a
    job's own hf_overrides kept beside it."""
    from pipelinerl.spec import parse_job
    from pipelinerl_generator.engine import engine_args

    spec = {"model": {"path": str(tiny_qwen2), "dtype": "bfloat16"}}
    spec["generator"] = {"engineArgs": {"hf_overrides": {"rope_theta": 5000.0}}}
    job = parse_job(
        {"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "metadata": {"name": "h"}, "spec": spec}
    )
    config = engine_args(job, str(tiny_qwen2), seed=0).create_model_config()
    assert (config.dtype, config.head_dtype) == (torch.bfloat16, torch.float32)
    assert config.hf_config.rope_theta == 5000.0


async def test_weights_vllm_derives_after_loading_send_the_update_through_its_reload():
    """`load_blockers` names what an in-place copy would leave stale; the tiny model has none
    (the engines above take the staged path), plain linear layers have none."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from pipelinerl_generator.weight_receiver import load_blockers

    def module(**attrs):
        m = torch.nn.Module()
        for k, v in attrs.items():
            setattr(m, k, v)
        return m

    class Sinks:
        _sinks_source = torch.zeros(2)

    model = torch.nn.Module()
    model.linear = module(quant_method=UnquantizedLinearMethod())
    assert load_blockers(model) == []
    model.fp8 = module(quant_method=object())
    model.gate = module(_bf16x3_weight=torch.zeros(1))
    model.attn = module(impl=Sinks())
    assert load_blockers(model) == [
        "fp8: quantized (object)",
        "gate: bf16x3_weight derived at load",
        "attn: attention sinks copied to float32",
    ]


@contextlib.contextmanager
def bound_of(engine, seconds: float):
    """The engine's bound on calls into its core shortened to `seconds` for a test, then restored."""
    bound, engine.rpc_timeout_s = engine.rpc_timeout_s, seconds
    try:
        yield bound
    finally:
        engine.rpc_timeout_s = bound


async def test_a_call_that_blocks_the_engine_core_is_given_up_on_in_bounded_time(engines):
    """vLLM's one-worker executor (one GPU, the CPU build) runs a worker call on the engine
    core's own thread and ignores vLLM's `timeout`: a call blocked there (an NCCL collective that
    never completes does not raise) would be awaited forever, and generation with it. The
    engine gives up on it after its bound, naming the call (EngineStuck: the generator stops,
    its pod restarts); vLLM drops the late answer, and the core answers again once free."""
    engine = (await engines(False)).engine
    with bound_of(engine, 1.0) as bound:
        assert bound == 2 * SYNC_TIMEOUT_S + 30  # past every weight-sync wait of its own
        t0 = time.monotonic()
        with pytest.raises(EngineStuck, match="probe_block within 1 s"):
            await engine._rpc("probe_block", 4.0)
        assert time.monotonic() - t0 < 3.0
    assert await engine._rpc("probe_staging_alive") == [False]  # answered after the block


async def test_a_core_stalled_in_a_step_fails_the_liveness_check(engines):
    """The generator checks that its engine's core answers between steps (every 30 s): a core
    held by anything (here a worker call sleeping on its thread, as a hung kernel would hold a
    step) fails the check in bounded time with no weight update pending; a free core passes."""
    engine = (await engines(False)).engine
    await engine.check_alive()
    blocked = asyncio.create_task(engine.llm.collective_rpc("probe_block", args=(4.0,)))
    try:
        with bound_of(engine, 1.0):
            await asyncio.sleep(0.2)  # the block has reached the core
            t0 = time.monotonic()
            with pytest.raises(EngineStuck, match="a liveness check"):
                await engine.check_alive()
            assert time.monotonic() - t0 < 3.0
    finally:
        await blocked
    await engine.check_alive()


async def test_a_generator_frozen_past_the_bound_with_a_call_pending_goes_on_when_thawed(engines):
    """A paused pod (SIGSTOP to the generator's process and its engine core, a frozen node) for
    longer than the bound on calls into the core, while one is pending: on thawing, the core
    answers it, and the generator goes on. The bound counts the time the generator was awake
    (its loop running): a freeze is no sign of a blocked core, and the core was frozen with it.
    (Before, asyncio's clock counted the freeze: EngineStuck, a restart.)"""
    engine = (await engines(False)).engine
    core = engine.llm.engine_core.resources.engine_manager.processes[0].pid  # vLLM's handle
    pids = f"{core} {os.getpid()}"
    with bound_of(engine, 2.0):
        os.kill(core, signal.SIGSTOP)  # the core first, so that the call stays pending
        # The generator's own process (this one) too, 0.3 s into the call, for 4 s; then both.
        thaw = subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -STOP {pids}; sleep 4; kill -CONT {pids}"])
        try:
            t0 = time.monotonic()
            await engine.check_alive()
            assert time.monotonic() - t0 > 4.0  # answered after the thaw, 2 s past the bound
        finally:
            thaw.wait(10)
            os.kill(core, signal.SIGCONT)
    await engine.check_alive()


async def test_an_engine_of_two_workers_joins_beside_generation_and_its_answers_stay_in_step(tmp_path, monkeypatch):
    """Tensor parallelism runs vLLM's multiprocess executor, which raises at the first worker
    whose call raised and leaves the others' answers queued. Two CPU workers (ranks 1 and 2 of a
    real gloo epoch): both join beside generation and an update lands on both shards; a join
    the trainer calls off is told by both, and the next call's answers are its own; a call that
    raises all the same stops the generator (WorkersOutOfStep)."""
    from pipelinerl.tiny_model import make_tokenizer
    from pipelinerl.weight_group import GROUP_PREFIX, WeightSyncError, open_store
    from pipelinerl_generator.engine import Engine

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a worker per core (vLLM binds one per NUMA node)
    paths, job, buckets = models_and_job(tmp_path, "inflight-tp")
    # The spec gives tensor parallelism GPUs only (a CPU pod gains nothing by it); vLLM's CPU build
    # runs it, which is all this test needs.
    object.__setattr__(job.spec.generator, "tensor_parallel", 2)
    cmd_q, res_q, port, sender = start_sender(paths)
    engine = Engine(job, paths["A"])
    tok = make_tokenizer()
    prompt = tok.encode(PROMPTS[0])
    try:
        await engine.start(0)
        cmd_q.put(("init", "t1", 3))
        await engine.join_weight_group(HOST, port, "t1", 1, 3, SYNC_TIMEOUT_S)
        await reply(res_q)
        running = asyncio.create_task(engine.generate(prompt, LONG_TOKENS))
        await wait_for_output_tokens(engine, 5)
        cmd_q.put(("send", "B", buckets))
        stats = await engine.update_weights(1, buckets)
        await reply(res_q)
        await running
        assert stats.staged and engine.version == 1
        hf_b = load_hf(paths["B"])
        assert (await engine.generate(prompt, N_GREEDY, greedy=True)).tokens == hf_greedy(hf_b, prompt, N_GREEDY)

        called_off = open_store(HOST, port, False, 10.0)
        called_off.set(f"{GROUP_PREFIX}/t2/go", "abort")
        with pytest.raises(WeightSyncError, match="called off by the trainer"):
            await engine.join_weight_group(HOST, port, "t2", 1, 3, SYNC_TIMEOUT_S)
        # Raised at the first worker that told it; the other's join ends with the same word (its
        # own state, told once), and the answers after are the calls' own.
        answers = await engine._rpc("weight_group_joined")
        while None in answers:
            answers = await engine._rpc("weight_group_joined")
        assert all(a == "no weight group is being joined" or "called off by the trainer" in a for a in answers)
        assert await engine._rpc("weight_group_joined") == ["no weight group is being joined"] * 2
        assert (await engine.generate(prompt, N_GREEDY, greedy=True)).tokens == hf_greedy(hf_b, prompt, N_GREEDY)

        with pytest.raises(WorkersOutOfStep, match="commit_staged_weights"):
            await engine._rpc("commit_staged_weights")  # nothing staged: it raises on both workers
    finally:
        stop(cmd_q, engine, sender)
