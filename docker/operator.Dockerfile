# The PipelineRLJob operator: kopf + the spec models; no torch, no vLLM.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t pipelinerl-operator .
# (or `make images`, with buildah)
# BASE: the published python:3.11-slim by default; `make images` passes one built from Debian's
# packages alone (scripts/base-image.sh), the same Debian release, where no registry is reachable.
ARG BASE=python:3.11-slim
FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# A venv of its own: the same on either base (Debian's Python refuses system-wide pip installs).
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY requirements/lock.txt ./requirements/lock.txt
COPY pyproject.toml README.md ./
COPY pipelinerl ./pipelinerl
COPY operator ./operator
COPY services ./services
COPY cli ./cli
# --no-deps: the operator needs only these, not the training stack the project depends on
# (kubernetes-validate: its admission check validates rendered pods against the Kubernetes schema),
# at the versions the tests run (the lock as constraints).
RUN pip install --no-deps . \
 && pip install -c requirements/lock.txt pydantic pyyaml kopf kubernetes aiohttp nats-py prometheus-client kubernetes-validate
USER 10001
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "pipelinerl_operator"]
