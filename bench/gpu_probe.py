"""What the GPU check's parts import, tried one by one (bench/gpu_check.py runs this before and
after installing .whl/): one JSON line on stdout, {"missing": {module: its error}, "versions":
"python 3.12.3 | torch 2.11.0 | ..."}. Standard library only, but for what it tries."""

from __future__ import annotations

import importlib
import json
import sys

# What the parts import that the GPU image may lack: pydantic and hjson come from .whl/ (and
# DeepSpeed, built from its sdist there); the rest the image has.
MODULES = ("pydantic", "yaml", "msgpack", "hjson", "transformers", "pytest_timeout", "deepspeed", "torch")


def main() -> None:
    missing: dict[str, str] = {}
    found = [f"python {sys.version.split()[0]}"]
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # any failure to import is what the check must know
            missing[name] = (f"{type(e).__name__}: {e}".splitlines() or [""])[0][:200]
            continue
        found.append(f"{name} {getattr(module, '__version__', '')}".strip())
    if "torch" not in missing:
        import torch

        found.append(f"CUDA {torch.cuda.is_available()}")
    print(json.dumps({"missing": missing, "versions": " | ".join(found)}), flush=True)


if __name__ == "__main__":
    main()
