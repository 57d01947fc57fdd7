"""The PipelineRLJob operator: pure rendering (render.py) and status (status.py) wrapped by kopf (handlers.py)."""
