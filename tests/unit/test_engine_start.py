"""How the generator's vLLM engine core process starts (services/generator/.../engine.py): forked
while no thread of the generator's runs, spawned otherwise (on GPUs too); a forked core's
signals stay its own; it starts with torch.compile off, and the generator's process is left as
it was."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading

import pytest

from pipelinerl_generator.engine import (
    compile_disabled,
    core_start_method,
    forget_parent_signals_after_fork,
    threads_running,
)


@pytest.mark.parametrize(
    ("executor", "threads", "method"),
    [
        ("uni", 1, "fork"),  # one thread: nothing to copy half-taken
        ("uni", 2, "spawn"),  # a second thread (an HTTP server, OpenMP's pool) may hold a lock
        ("mp", 1, "spawn"),  # the core would start workers from a process with threads by then
        ("mp", 9, "spawn"),
    ],
)
def test_the_core_is_forked_only_from_a_single_threaded_generator(executor, threads, method):
    # On GPUs too: vLLM would fork there by itself (unless CUDA is initialised), from a generator
    # whose health server already runs, and the core's SIGTERM would reach the generator's loop.
    assert core_start_method(executor, threads) == method


def test_threads_are_counted_as_the_kernel_sees_them():
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert str(thread.native_id) in os.listdir("/proc/self/task") and threads_running() >= 2
    finally:
        release.set()
        thread.join()


def _catch_own_sigterm() -> None:
    signal.signal(signal.SIGTERM, lambda *_: None)  # as vLLM's engine core does
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_forked_cores_own_signal_does_not_reach_the_generators_event_loop():
    # The child inherits the loop's wakeup fd: without the at-fork reset, the SIGTERM vLLM's core
    # gets at every engine shutdown was read by the generator's loop as its own, and stopped it.
    forget_parent_signals_after_fork()
    loop = asyncio.new_event_loop()
    heard: list[str] = []
    loop.add_signal_handler(signal.SIGTERM, heard.append, "SIGTERM")
    try:
        child = multiprocessing.get_context("fork").Process(target=_catch_own_sigterm)
        child.start()
        child.join(30)
        assert child.exitcode == 0
        loop.run_until_complete(asyncio.sleep(0.5))  # a byte in the loop's self-pipe is read here
        assert heard == []
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.close()


def report_compile(out) -> None:
    import torch._dynamo

    out.put((torch._dynamo.config.disable, os.environ.get("TORCH_COMPILE_DISABLE")))


def test_compile_is_off_in_a_core_started_meanwhile_and_back_on_after():
    import torch._dynamo

    assert not torch._dynamo.config.disable and "TORCH_COMPILE_DISABLE" not in os.environ
    for method in ("fork", "spawn"):
        ctx = multiprocessing.get_context(method)
        out = ctx.Queue()
        with compile_disabled(True):
            proc = ctx.Process(target=report_compile, args=(out,))
            proc.start()
        assert out.get(timeout=60) == (True, "1"), method
        proc.join(30)
    # This process (a test's that builds an engine, too) compiles again; with False nothing changes.
    assert not torch._dynamo.config.disable and "TORCH_COMPILE_DISABLE" not in os.environ
    with compile_disabled(False):
        assert not torch._dynamo.config.disable


def test_a_checkpoint_quantized_ahead_is_refused_by_field_and_online_quantization_is_not():
    """Its packed weights and scales have no counterpart in the trainer's 16-bit broadcast (vLLM's
    reload would cast the weights into them silently); a 16-bit checkpoint is quantized online."""
    from pipelinerl_generator.engine import quantized_ahead

    assert quantized_ahead({"model_type": "qwen2", "torch_dtype": "bfloat16"}) is None
    refused = quantized_ahead({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert refused is not None and refused.startswith("spec.model.path: a checkpoint quantized ahead (fp8)")
    assert "engineArgs.quantization" in refused
