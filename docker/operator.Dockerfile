# The PipelineRLJob operator: kopf + the spec models; no torch, no vLLM.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t pipelinerl-operator .
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipelinerl ./pipelinerl
COPY operator ./operator
COPY services ./services
COPY cli ./cli
# --no-deps: the operator needs only these, not the training stack the project depends on
# (kubernetes-validate: its admission check validates rendered pods against the Kubernetes schema).
RUN pip install --no-deps . \
 && pip install "pydantic>=2.7" pyyaml kopf kubernetes aiohttp nats-py prometheus-client kubernetes-validate
USER 10001
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "pipelinerl_operator"]
