"""The small jobs the end-to-end tests run (a random tiny model: machinery, not learning)."""


def tiny_job(name: str, **spec) -> dict:
    base = {
        "model": {"path": "builtin:tiny-random", "maxSeqLen": 40},
        "task": {"name": "arith"},
        "rl": {"attempts": 4, "filterZeroVariance": False},
        "generator": {"sampling": {"maxTokens": 24}},
        "trainer": {"samplesPerStep": 16, "microBatchTokens": 256, "maxSteps": 5, "checkpointInterval": 0},
        "eval": {"interval": 2, "problems": 16},
    }
    for key, value in spec.items():
        base[key] = base.get(key, {}) | value if isinstance(value, dict) else value
    return {"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "metadata": {"name": name},
            "spec": base}
