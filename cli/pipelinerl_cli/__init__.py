"""The face of PipelineRL: the `pipelinerl` command, the one-machine runner (`pipelinerl run`), its
embedded NATS server and process helpers. It sits above the services and the operator and may
import them; nothing below imports it."""
