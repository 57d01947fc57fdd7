"""The GPU check (bench/gpu_check.py, `bash bench/gpu_check.sh`), which must work the first time a
GPU is lent: the exact command lines it runs parse, what it prints leaves out the noise that
would push the first parts out of the device tool's 12,000-character tail, each part gets what
is left of one budget, a failed DeepSpeed install skips only what needs DeepSpeed, and `--smoke`
runs the whole script on CPU (slow) with the log and every JSON in the output folder."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check, gpu_commit, gpu_decode, gpu_trainer, gpu_weight_update
from bench.gpu_check import GRACE_S, MIN_PART_S, SUMMARY_S, Check, Filter, part_timeout, plan, without_deepspeed

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "bench" / "README.md"


def parts(smoke: bool, out: Path) -> dict[str, gpu_check.Part]:
    return {p.name: p for p in plan(smoke, out)}


@pytest.mark.parametrize("smoke", [False, True])
def test_every_command_line_the_check_runs_parses(smoke, tmp_path):
    got = parts(smoke, tmp_path)
    # newest first (the trainer ranks' watch), then by value
    assert list(got) == list(gpu_check.PART_NAMES) and gpu_check.PART_NAMES[0] == "trainer-peers"
    peers = got["trainer-peers"].argv
    assert peers[:2] == ["-m", "pytest"] and "tests/integration/test_trainer_collectives.py" in peers
    assert peers[peers.index("-k") + 1] == ("gloo" if smoke else "nccl")
    ckpt = got["checkpoint"]
    assert ckpt.pytest and ckpt.needs_deepspeed and "tests/integration/test_checkpoint.py" in ckpt.argv
    assert ckpt.argv[ckpt.argv.index("-k") + 1] == ("gloo" if smoke else "nccl")
    plane = got["weight-plane"].argv
    assert plane[:2] == ["-m", "pytest"] and plane[plane.index("-k") + 1] == ("cpu" if smoke else "cuda") + " or killed"
    assert {f"tests/integration/test_{name}.py" for name in ("commit_graphs", "weight_group", "weight_join")} <= set(
        plane
    )
    commit = got["commit-7B"].argv
    assert commit[:2] == ["-m", "bench.gpu_commit"] and ("--smoke" in commit) == smoke
    commit_args = gpu_commit.parse_args(commit[2:])
    assert commit_args.name == got["commit-7B"].result and commit_args.results_dir == tmp_path
    decode = got["decode-curve"].argv
    assert decode[:2] == ["-m", "bench.gpu_decode"] and ("--smoke" in decode) == smoke
    decode_args = gpu_decode.parse_args(decode[2:])
    assert decode_args.name == got["decode-curve"].result and decode_args.results_dir == tmp_path
    assert decode_args.models == ("smoke" if smoke else "1.5B,7B")
    trainer = {}
    for name in ("0.5B", "1.5B", "1.5B-16k"):
        argv = got[name].argv
        assert argv[:2] == ["-m", "bench.gpu_trainer"]
        assert "--sides" in argv  # never the default sides: the part's own, named
        trainer[name] = gpu_trainer.parse_args(argv[2:])
        assert trainer[name].results_dir == tmp_path and f"{trainer[name].name}" == got[name].result
    compiled = [] if smoke else ["zero1+compile"]  # compiling for a CPU takes minutes and measures nothing
    assert trainer["0.5B"].side_list == ["stock", "plain", "zero1", *compiled] and trainer["0.5B"].profile
    assert trainer["1.5B"].side_list == ["stock", "zero1", *compiled]
    assert trainer["1.5B-16k"].side_list == ["zero1"]
    assert trainer["0.5B"].target_pair == (1.5, 0.20) and trainer["1.5B"].target_pair == (1.5, 0.30)
    assert trainer["1.5B"].memory_cap_gb == trainer["1.5B-16k"].memory_cap_gb == 80
    assert trainer["1.5B-16k"].micro_batch_tokens == (512 if smoke else 16384)
    if not smoke:
        assert [trainer[n].size for n in trainer] == ["0.5B", "1.5B", "1.5B"]
        assert trainer["1.5B-16k"].micro_batch_tokens > trainer["1.5B"].micro_batch_tokens
    update = got["weight-update"].argv
    assert update[:2] == ["-m", "bench.gpu_weight_update"]
    args = gpu_weight_update.parse_args(update[2:])
    assert args.name == got["weight-update"].result and args.results_dir == tmp_path
    assert args.size == ("smoke" if smoke else "1.5B")
    tests = got["gpu-tests"].argv
    assert tests[:2] == ["-m", "pytest"] and tests[tests.index("--timeout") + 1] == "120" and "-rfEs" in tests
    # The smoke collects the pytest parts' selections (the suite runs those tests); a GPU runs them.
    assert ("--collect-only" in plane) == ("--collect-only" in tests) == smoke


def test_a_tag_that_starts_with_a_dash_goes_after_an_equals_sign():
    assert gpu_trainer.parse_args(["--size", "1.5B", "--tag=-16k"]).name == "gpu_trainer-1.5B-16k"
    with pytest.raises(SystemExit):  # argparse takes "-16k" for an option: the form the old script used
        gpu_trainer.parse_args(["--size", "1.5B", "--tag", "-16k"])


def test_the_readmes_benchmark_6_command_lines_parse():
    lines = [ln.strip() for ln in README.read_text().splitlines()]
    commands = [ln.split("#")[0] for ln in lines if ln.startswith("python -m bench.gpu_")]
    assert len(commands) >= 5
    for command in commands:
        argv = shlex.split(command)
        module = {"bench.gpu_trainer": gpu_trainer, "bench.gpu_weight_update": gpu_weight_update}[argv[2]]
        module.parse_args(argv[3:])  # exits (a failed test) on any option argparse refuses


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--sides", "stock,zero2"], "--sides"),
        (["--targets", "1.5"], "--targets"),
        (["--name", "a/b"], "--name"),
        (["--tag", "x y"], "--name/--tag"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_options_are_refused_naming_the_field(argv, field, capsys):
    with pytest.raises(SystemExit):
        gpu_trainer.parse_args(argv)
    assert field in capsys.readouterr().err


def test_smoke_changes_the_defaults_and_explicit_options_still_apply():
    args = gpu_trainer.parse_args(["--smoke", "--micro-batch-tokens", "512", "--sides", "zero1"])
    assert (args.size, args.samples, args.micro_batch_tokens, args.side_list) == ("smoke", 8, 512, ["zero1"])
    assert gpu_trainer.parse_args([]).side_list == ["stock", "plain", "zero1", "zero3"]


def test_the_printed_output_leaves_out_progress_bars_log_info_and_warnings():
    f = Filter()
    noise = [
        "Loading weights: 100%|██████████| 26/26 [00:00<00:00, 2045.04it/s]",
        "Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]",
        "[2026-11-27 18:34:20,081] [INFO] [config.py:1003:print] bfloat16_enabled ............. True",
        "[2026-11-27 18:34:20,081] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
        "/x/torch/distributed/c10d_logger.py:83: FutureWarning: `all_gather_into_tensor` is deprecated.",
        "  return func(*args, **kwargs)",  # the source line under the warning
        "   ",
    ]
    assert [line for line in noise if f.shown(line + "\n")] == []
    kept = [
        "  zero1: 0.839 s/step, 305 tokens/s, 1.62× stock (9 s)",
        "VERDICT 0.5B: best project side plain: 1.60× stock HF (target ≥ 1.5×: met), MFU 31.0% (target ≥ 20%: met)",
        "  stock failed: out of memory: CUDA out of memory. Tried to allocate 4.6 GiB",
        "[2026-11-27 18:34:20,081] [ERROR] [engine.py:1:x] something broke",
    ]
    assert [line for line in kept if f.shown(line + "\n")] == kept


def test_pytests_output_is_reduced_to_its_failures_and_totals():
    f = Filter(pytest=True)
    out = [
        "....F.s",
        "tests/gpu/test_gpu_trainer.py:20: AssertionError",
        "FAILED tests/gpu/test_gpu_trainer.py::test_varlen - AssertionError: torch.nn.attention.varlen is missing",
        "ERROR tests/integration/test_weight_group.py::test_nccl - Failed: Timeout (>120.0s) from pytest-timeout.",
        "1 failed, 2 passed, 1 skipped, 1 error, 13 deselected in 141.20s (0:02:21)",
    ]
    assert [line for line in out if f.shown(line)] == out[2:]
    assert f.kept == out[2:]  # the part's summary lines


def test_each_part_gets_what_is_left_of_the_budget_up_to_its_cap():
    assert part_timeout(150, 400) == 150
    assert part_timeout(150, 100) == 100 - GRACE_S - SUMMARY_S
    assert part_timeout(150, MIN_PART_S + GRACE_S + SUMMARY_S) == MIN_PART_S
    assert part_timeout(150, MIN_PART_S + GRACE_S + SUMMARY_S - 1) is None  # skipped, said so


def test_without_deepspeed_only_the_zero_sides_are_skipped(tmp_path):
    got = parts(False, tmp_path)
    half, note = without_deepspeed(got["0.5B"])
    assert half is not None and gpu_trainer.parse_args(half.argv[2:]).side_list == ["stock", "plain"]
    assert note == "sides zero1,zero1+compile skipped: DeepSpeed did not install"
    one, note = without_deepspeed(got["1.5B"])  # no project side would be left: plain instead of zero1
    assert one is not None and gpu_trainer.parse_args(one.argv[2:]).side_list == ["stock", "plain"]
    assert note == "sides zero1,zero1+compile skipped: DeepSpeed did not install; plain instead"
    assert without_deepspeed(got["1.5B-16k"]) == (None, "skipped: all its sides need DeepSpeed, which did not install")
    assert without_deepspeed(got["weight-update"]) == (None, "skipped: it needs DeepSpeed, which did not install")
    assert without_deepspeed(got["checkpoint"]) == (None, "skipped: it needs DeepSpeed, which did not install")


def test_parts_that_need_deepspeed_say_they_were_skipped_and_a_part_past_the_budget_too(tmp_path, capsys):
    check = Check(gpu_check.parse_args(["--out", str(tmp_path), "--budget", "60"]))
    check.install = {"deepspeed": False}
    got = parts(False, tmp_path)
    check.do_part(got["1.5B-16k"])  # nothing of it runs without DeepSpeed
    check.start -= 60  # the budget is spent
    check.do_part(got["gpu-tests"])
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert [(p["name"], p["status"]) for p in saved] == [("1.5B-16k", "skipped"), ("gpu-tests", "skipped")]
    assert saved[0]["note"] == "skipped: all its sides need DeepSpeed, which did not install"
    assert re.fullmatch(r"skipped: 0 s left of the 60 s budget", saved[1]["note"])
    printed = capsys.readouterr().out
    assert "== 1.5B-16k: skipped: all its sides need DeepSpeed" in printed and "== gpu-tests: skipped" in printed
    assert printed.strip() in (tmp_path / "gpu_check.log").read_text()  # the log has what was printed


def test_a_trainer_parts_sides_make_one_summary_line():
    sides = {
        "stock": {"tokens_per_second": 55300.0, "vs_stock": 1.0, "mfu": 0.171, "peak_memory_gb": 21.4},
        "plain": {"tokens_per_second": 82950.0, "vs_stock": 1.5, "mfu": 0.256, "peak_memory_gb": 18.2},
        "zero3": {"error": "out of memory: CUDA out of memory. Tried to allocate 4.6 GiB"},
    }
    assert gpu_check.sides_line("0.5B", sides) == (
        "0.5B: stock 55,300 tok/s MFU 17% 21 GB | plain 82,950 tok/s 1.50× MFU 26% 18 GB"
        " | zero3 FAILED (out of memory: CUDA out of memory. Tried to allocate 4.6 GiB)"
    )


# Names the device tool brings back from $OUT: letters, digits, '.', '_', '-'; at most 8 files.
OUT_NAME = re.compile(r"[A-Za-z0-9._-]+")


@pytest.mark.slow
def test_the_smoke_mode_runs_the_whole_check_on_cpu_and_keeps_everything_in_out(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "gpu_check.json",
        "gpu_check.log",
        "gpu_commit-7B.json",
        "gpu_decode.json",
        "gpu_trainer-0.5B.json",
        "gpu_trainer-1.5B-16k.json",
        "gpu_trainer-1.5B.json",
        "gpu_weight_update-1.5B.json",
    ]
    assert len(files) <= 8 and all(OUT_NAME.fullmatch(f) for f in files)
    check = json.loads((out / "gpu_check.json").read_text())
    assert check["smoke"] and check["install"]["deepspeed"]
    assert [(p["name"], p["status"]) for p in check["parts"]] == [
        ("install", "ok"),
        *((name, "ok") for name in gpu_check.PART_NAMES),
    ]
    for name, ran in (
        ("gpu_trainer-0.5B", ["stock", "plain", "zero1"]),  # stock HF, plain PyTorch, real DeepSpeed
        ("gpu_trainer-1.5B", ["stock", "zero1"]),
        ("gpu_trainer-1.5B-16k", ["zero1"]),
    ):
        report = json.loads((out / f"{name}.json").read_text())
        sides = report["sides"]
        assert report["size"] == "smoke" and list(sides) == ran, (name, sides)
        assert all("seconds" in r for r in sides.values()), (name, sides)
    assert json.loads((out / "gpu_weight_update-1.5B.json").read_text())["exact"] is True
    assert json.loads((out / "gpu_commit-7B.json").read_text())["exact"] is True
    assert all(p["step_s"] > 0 for p in json.loads((out / "gpu_decode.json").read_text())["models"]["smoke"]["points"])
    printed = done.stdout
    summary = printed[printed.index("== summary") :]
    for line in (
        "VERDICT 0.5B: best project side",
        "VERDICT 1.5B: best project side",
        "VERDICT 1.5B-16k memory: zero1",
        "VERDICT weight update smoke:",
        "VERDICT commit of a staged update (smoke shape",
    ):
        assert line in summary, line
    peers = next(p for p in check["parts"] if p["name"] == "trainer-peers")  # gloo: a rank killed, one frozen
    assert any(re.search(r"\b2/\d+ tests collected", line) for line in peers["summary_lines"]), peers
    plane = next(p for p in check["parts"] if p["name"] == "weight-plane")
    # collected: the two commit tests' CPU stand-ins and the members killed, mid-broadcast and
    # before connecting, over gloo and NCCL (on a GPU they run; the suite runs the CPU ones)
    assert any(re.search(r"\b6/\d+ tests collected", line) for line in plane["summary_lines"]), plane
    assert len(printed) < 12_000  # the whole output fits the device tool's tail
    assert not re.search(r"it/s\]|\[INFO\]|Warning: ", printed)
    log = (out / "gpu_check.log").read_text()
    assert "tests collected" in log and "VERDICT weight update smoke" in log


# Makes DeepSpeed absent, as on the GPU image before the install (this machine has it): the
# import system no longer finds it, so neither do transformers' and accelerate's availability checks.
HIDE_DEEPSPEED = """
import importlib.machinery

_find = importlib.machinery.PathFinder.find_spec.__func__


def _find_spec(cls, fullname, path=None, target=None):
    if fullname == "deepspeed" or fullname.startswith("deepspeed."):
        return None
    return _find(cls, fullname, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(_find_spec)
"""


@pytest.mark.slow
def test_a_failed_deepspeed_install_skips_only_what_needs_deepspeed(tmp_path):
    """DeepSpeed is absent and its sdist does not build: the GPU tests still run, the 1.5B part
    runs without its ZeRO side (plain instead), the weight update says it was skipped."""
    site, wheels, out = tmp_path / "site", tmp_path / "whl", tmp_path / "out"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_DEEPSPEED)
    wheels.mkdir()
    (wheels / "deepspeed-0.0.tar.gz").write_bytes(b"not an sdist")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_CHECK_SITE=str(site), GPU_CHECK_WHEELS=str(wheels))
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--smoke", "--parts", "gpu-tests,1.5B,weight-update"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 1, done.stdout[-3000:]  # the install failed: said by the exit code too
    check = json.loads((out / "gpu_check.json").read_text())
    assert check["install"]["deepspeed"] is False
    assert check["install"]["missing_after"] == {"deepspeed": "ModuleNotFoundError: No module named 'deepspeed'"}
    status = {p["name"]: p for p in check["parts"]}
    assert status["install"]["status"] == "failed" and "DeepSpeed sdist: FAILED" in status["install"]["note"]
    assert status["gpu-tests"]["status"] == "ok"
    assert status["1.5B"]["status"] == "ok", (out / "gpu_check.log").read_text()[-3000:]
    assert status["1.5B"]["note"] == "sides zero1 skipped: DeepSpeed did not install; plain instead"
    assert list(json.loads((out / "gpu_trainer-1.5B.json").read_text())["sides"]) == ["stock", "plain"]
    assert status["weight-update"]["status"] == "skipped"
    assert "== weight-update: skipped: it needs DeepSpeed, which did not install" in done.stdout


def test_a_deepspeed_that_does_not_import_is_moved_out_of_the_scratch_site(tmp_path):
    site = tmp_path / "site"
    for name in ("deepspeed", "deepspeed-0.19.8.dist-info", "deepspeed_extra", "pydantic"):
        (site / name).mkdir(parents=True)
    assert gpu_check.quarantine(site, "deepspeed") == ["deepspeed", "deepspeed-0.19.8.dist-info"]
    assert sorted(p.name for p in site.iterdir()) == ["deepspeed_extra", "pydantic"]
    assert sorted(p.name for p in (tmp_path / "site-broken").iterdir()) == ["deepspeed", "deepspeed-0.19.8.dist-info"]
    assert gpu_check.quarantine(site, "deepspeed") == []


def test_the_decode_curve_part_measures_on_cpu_and_bounds_the_batch_by_kv_memory(tmp_path):
    """Its smoke (tiny shapes, eager) writes a point per batch, context and attention, and a fit
    per attention; the KV bytes it checks a point against are the static cache's (keys and
    values, every layer)."""
    gpu_decode.main(["--smoke", "--results-dir", str(tmp_path)])
    result = json.loads((tmp_path / "gpu_decode.json").read_text())
    smoke = result["models"]["smoke"]
    cells = [(b, c, a) for c in (16, 32) for b in (1, 4) for a in ("sdpa", "grouped")]
    assert [(p["batch"], p["context"], p["attention"]) for p in smoke["points"]] == cells
    assert all(p["step_s"] > 0 for p in smoke["points"])
    assert smoke["agree"] < 1e-5 and set(smoke["fits"]) == {"sdpa", "grouped"}
    assert len(result["verdict_lines"]) == 2
    seven = gpu_decode.MODELS["7B"]  # 28 layers, 4 KV heads of 128: 57,344 bytes a position in bf16
    assert gpu_decode.kv_bytes(seven, 1, 1) == 2 * 28 * 4 * 128 * 2
    assert gpu_decode.kv_bytes(seven, 512, 4096) > 100e9  # more than an H200 leaves after the weights


def test_grouped_attention_is_sdpa_without_copying_kv_heads():
    """The decode curve's `grouped` attention computes what transformers' sdpa computes (with its
    KV heads copied per query head): causal without a mask, a boolean and an additive mask,
    several queries and one; a grouping that pairs heads wrongly is caught."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Layer:
        is_causal, training, num_key_value_groups = True, False, 4

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    allowed = torch.rand(2, 1, 5, 9) > 0.3
    allowed[..., 0] = True  # every query attends to something
    additive = torch.zeros(2, 1, 5, 9).masked_fill(~allowed, float("-inf"))
    for query, mask in [(q, allowed), (q, additive), (q[:, :, -1:], allowed[:, :, -1:]), (q, None)]:
        keys, values = (k[:, :, :5], v[:, :, :5]) if mask is None else (k, v)  # causal: as many keys as queries
        expected, _ = sdpa_attention_forward(Layer(), query, keys, values, mask, scaling=0.25)
        got, _ = gpu_decode.grouped_attention(Layer(), query, keys, values, mask, scaling=0.25)
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)
    # Query head h paired with KV head h % 2 instead of h // 4: the heads reordered on the way in
    # and back on the way out, so that only the pairing differs from sdpa's.
    swapped = q.reshape(2, 4, 2, 5, 16).transpose(1, 2).reshape(2, 8, 5, 16)
    wrong, _ = gpu_decode.grouped_attention(Layer(), swapped, k, v, allowed, scaling=0.25)
    wrong = wrong.reshape(2, 5, 2, 4, 16).transpose(2, 3).reshape(2, 5, 8, 16)
    expected, _ = sdpa_attention_forward(Layer(), q, k, v, allowed, scaling=0.25)
    alike, unlike = [0, 2, 5, 7], [1, 3, 4, 6]  # h // 4 == h % 2, and not
    assert torch.allclose(wrong[:, :, alike], expected[:, :, alike], atol=1e-5)
    assert not torch.allclose(wrong[:, :, unlike], expected[:, :, unlike], atol=1e-3)
