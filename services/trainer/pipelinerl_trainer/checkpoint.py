"""Checkpoints: DeepSpeed state (model, optimizer) + Hugging Face weights + what was consumed.

Layout: <dir>/step-<N>/{ds/, hf/, state.json} and <dir>/latest (written last, atomically), so
a crash mid-save leaves the previous checkpoint in force. Exports (weights only, for offline
evaluation) go to <dir>/export/version-<N>/. All ranks call save/load/export (DeepSpeed saves
its shards collectively; ZeRO-3 gathers the full weights collectively).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from pipelinerl_trainer.model import full_parameters

log = logging.getLogger("pipelinerl.trainer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def latest(ckpt_dir: Path) -> Path | None:
    marker = ckpt_dir / "latest"
    if not marker.exists():
        return None
    return ckpt_dir / marker.read_text().strip()


def save(engine, ckpt_dir: Path, step: int, state: dict, rank: int, model_path: str | None = None) -> Path:
    tag = f"step-{step}"
    target = ckpt_dir / tag
    engine.save_checkpoint(str(target / "ds"), tag="ds", client_state={"pipelinerl": state})
    _save_hf(engine, target / "hf", rank, model_path)
    if rank == 0:
        (target / "state.json").write_text(json.dumps(state, indent=1))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        tmp = ckpt_dir / "latest.tmp"
        tmp.write_text(tag)
        os.replace(tmp, ckpt_dir / "latest")
        log.info("checkpoint %s written", target)
    return target


def export(engine, ckpt_dir: Path, version: int, rank: int, model_path: str | None = None) -> Path:
    """The weights of `version` as a Hugging Face folder (no optimizer state): cheap enough to
    take every few steps, so versions can be evaluated offline without slowing the run."""
    target = ckpt_dir / "export" / f"version-{version}"
    tmp = target.with_name(target.name + ".tmp")
    _save_hf(engine, tmp, rank, model_path)
    if rank == 0:
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # a folder that exists is complete
    return target


def _save_hf(engine, target: Path, rank: int, model_path: str | None) -> None:
    with full_parameters(engine, list(engine.module.parameters())):
        if rank == 0:
            engine.module.save_pretrained(target, safe_serialization=True)
            src = Path(model_path or engine.module.config._name_or_path)
            for name in TOKENIZER_FILES:
                if (src / name).exists():
                    shutil.copy(src / name, target / name)


def load(engine, ckpt_dir: Path) -> dict:
    """Restore the latest checkpoint into `engine`; the consumed-data state, or {} if none."""
    target = latest(ckpt_dir)
    if target is None:
        return {}
    _, client = engine.load_checkpoint(str(target / "ds"), tag="ds")
    state = (client or {}).get("pipelinerl", {})
    log.info("resumed from %s at step %s", target, state.get("step"))
    return state
