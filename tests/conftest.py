import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Project-local caches: tests never write to the home folder and CI starts clean.
os.environ.setdefault("PIPELINERL_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
