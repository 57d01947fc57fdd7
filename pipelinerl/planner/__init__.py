"""Cluster planner: predict pipeline vs sync throughput, lag and idle time before renting GPUs.

A top-layer tool, like the CLI that runs it (`pipelinerl plan`): it imports the rules it
simulates from pipelinerl's core (admission, steps), and nothing in pipelinerl's core imports it.
The cost model and its assumptions are in docs/planner.md.

- `calibration`: the per-device costs a simulation runs on (`Calibration`), loaded from a file
  or from the built-ins in `pipelinerl/calibrations/<name>.yaml`.
- `sim_params`: a simulation's parameters (`SimParams`), its result (`SimResult`), its measuring
  window and the size of the waves a step is streamed in (`wave_groups`).
- `simulation`: the discrete-event simulation of one run (`simulate`): its state and event loop.
- `bound`: the samples/s ratio the pipeline can reach against conventional k from measured
  physics alone (a decode curve, the trainer by cores), with the tail counted.
- `recommend`: the search over device splits and max lags (`plan`) and its report (`format_plan`).
- `pilot`: a calibration from a pilot run's files (`derive_calibration`: `pipelinerl plan
  --calibrate-from`).
"""
