"""The PipelineRLJob operator: pure rendering (render.py) and status (status.py), applied by one
reconciling pass (reconcile.py) that kopf runs (handlers.py)."""
