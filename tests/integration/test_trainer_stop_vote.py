"""Two trainer ranks asked to stop at different moments, one with micro-batches waiting and the
other waiting for its next: with the vote before each micro-batch (`pipelinerl_trainer.stopping`)
and the word going round the ranks' store (`peers.PeerWatch.asked`), both stop at the same
micro-batch and meet in the stop checkpoint's collective, having trained as many. Each micro-batch
is a collective in the world group, as ZeRO-3's forward is. Real processes, a real gloo group."""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
import time

import pytest
from rank_processes import rank_of_two  # tests/integration/rank_processes.py

BOUND_S = 4.0
DEATH_BOUND_S = 20.0  # the watch's bound where a rank dies: far past the vote's own failure, on a loaded machine too
ASKED_AT_S = 4.0

pytestmark = pytest.mark.slow


def rank_process(
    rank: int, port: int, stopped: int | None, arrive: list[float], bound_s: float = BOUND_S
) -> subprocess.Popen:
    """Rank `rank` of 2: its micro-batches come at the times `arrive` (s after the start, none
    after them); rank `stopped` is asked to stop (its signal) at ASKED_AT_S; `bound_s`: the
    ranks' watch's."""
    code = textwrap.dedent(
        f"""
        import json, threading, time
        from datetime import timedelta
        import torch, torch.distributed as dist
        from pipelinerl_trainer.peers import PeerWatch
        from pipelinerl_trainer.stopping import StopVote
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        stop = threading.Event()
        watch = PeerWatch.of_ranks("127.0.0.1", {port}, {rank}, 2, {bound_s}, stop)
        vote = StopVote.of_ranks(2, 30)
        print("ready", flush=True)
        start = time.monotonic()
        if {rank} == {stopped}:
            threading.Timer({ASKED_AT_S}, stop.set).start()
        arrive, trained, waited = {arrive!r}, 0, 0

        def next_batch():
            while not (stop.is_set() or watch.asked.is_set()):
                if trained < len(arrive) and time.monotonic() - start >= arrive[trained]:
                    return trained
                time.sleep(0.01)
            return None

        def while_waiting():
            global waited
            waited += 1

        while not vote(next_batch() is None, while_waiting):
            dist.all_reduce(torch.ones(4))  # the micro-batch's collective
            trained += 1
        rows = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
        dist.all_gather(rows, torch.tensor([trained]))  # the stop checkpoint's
        print(json.dumps({{"trained": [int(r) for r in rows], "waited": waited, "asked": watch.asked.is_set()}}))
        watch.close()
        dist.destroy_process_group()  # as the trainer does: left to the exit, gloo aborted it now and then
        """
    )
    return rank_of_two(code, rank, port)


@pytest.mark.parametrize(
    "stopped, arrive",
    [
        # Rank 0 asked while rank 1 has micro-batches waiting (all of them came at once, and rank
        # 1 waits in the vote for rank 0's, which come one every 1.3 s).
        (0, [[1.3 * i for i in range(1, 30)], [0.0] * 30]),
        # Rank 1 drained while rank 0 waits for a micro-batch that does not come: rank 0 hears it
        # from the store, with a beat, and votes to stop.
        (1, [[0.2, 0.4], [0.0] * 30]),
    ],
    ids=["asked-with-work-waiting", "drained-while-the-other-waits"],
)
def test_ranks_asked_at_different_moments_stop_at_the_same_micro_batch(port, stopped, arrive) -> None:
    ranks = [rank_process(r, port, stopped, arrive[r]) for r in (0, 1)]
    try:
        outs = []
        for p in ranks:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in ranks:
            p.kill()
    trained = outs[0]["trained"]
    assert outs[1]["trained"] == trained and trained[0] == trained[1], outs
    assert 2 <= trained[0] < 29, outs  # stopped midway, after what came before the ask
    assert outs[1]["waited"] >= 1, outs  # rank 1 waited in the vote for rank 0, its duties going on
    if stopped == 1:
        assert outs[0]["asked"] and trained[0] == 2, outs  # rank 0 stopped on rank 1's word


def test_a_vote_waiting_for_a_rank_that_died_fails_at_once(port) -> None:
    """Rank 0 waits in the vote for rank 1, which waits for its micro-batch and is killed: rank
    0's vote raises the group's error within moments, before the ranks' watch's bound."""
    ranks = [rank_process(r, port, None, arrive, DEATH_BOUND_S) for r, arrive in ((0, [0.0] * 30), (1, []))]
    try:
        for p in ranks:  # both in their groups (a loaded machine imports torch slowly)
            assert p.stdout is not None and p.stdout.readline() == "ready\n", p.stderr.read() if p.stderr else ""
        time.sleep(1.0)  # rank 0 waiting in the vote
        assert ranks[0].poll() is None
        ranks[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = ranks[0].communicate(timeout=60)
        ended_s = time.monotonic() - t0
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert ranks[0].returncode != 0 and "said nothing" not in err, err[-3000:]  # not the watch
    assert ended_s < DEATH_BOUND_S / 2, (ended_s, err[-3000:])
    assert "pipelinerl_trainer/stopping.py" in err, err[-3000:]  # in the vote
