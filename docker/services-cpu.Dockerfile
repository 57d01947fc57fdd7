# CPU services image: generator (vLLM CPU build), preprocessor, trainer (DeepSpeed on gloo).
# Runs the tiny default job; the operator uses it for roles with gpus: 0.
# Build from the repository root:  docker build -f docker/services-cpu.Dockerfile -t pipelinerl-services .
# (or `make images`, with buildah)
# BASE: the published python:3.11-slim by default; `make images` passes one built from Debian's
# packages alone (scripts/base-image.sh), the same Debian release, where no registry is reachable.
ARG BASE=python:3.11-slim
FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    DS_ACCELERATOR=cpu VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_CACHE_ROOT=/var/cache/pipelinerl/vllm TORCHINDUCTOR_CACHE_DIR=/var/cache/pipelinerl/inductor \
    PIPELINERL_CACHE=/var/cache/pipelinerl
RUN apt-get update && apt-get install -y --no-install-recommends build-essential libnuma1 \
 && rm -rf /var/lib/apt/lists/*
# A venv of its own: the same on either base (Debian's Python refuses system-wide pip installs).
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
# The exact versions the tests run (requirements/lock.txt, as scripts/setup.sh installs them;
# torch's +cpu build from PyTorch's CPU index, or TORCH_INDEX= where pip's own configuration
# brings it), then the project itself. The download cache stays out of the image (a cache mount).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY requirements/lock.txt ./requirements/lock.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} --no-deps -r requirements/lock.txt
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
