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
# The exact versions the tests run (requirements/lock.txt, as scripts/setup.sh installs them;
# torch's +cpu build comes from the CPU index), then the project itself.
COPY requirements/lock.txt ./requirements/lock.txt
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu --no-deps -r requirements/lock.txt
COPY pyproject.toml README.md ./
COPY pipelinerl ./pipelinerl
COPY operator ./operator
COPY services ./services
COPY cli ./cli
COPY scripts ./scripts
RUN pip install --no-deps .
RUN useradd --uid 10001 --create-home pipelinerl && mkdir -p /var/cache/pipelinerl && chown -R 10001 /var/cache/pipelinerl
USER 10001
EXPOSE 8000
ENTRYPOINT ["pipelinerl"]
CMD ["--help"]
