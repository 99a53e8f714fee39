# kvmesh operator: kopf + kubernetes client, no torch. Runs as non-root with a read-only root
# filesystem (the chart mounts an emptyDir at /tmp).
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvmesh ./kvmesh
COPY operator ./operator
COPY engine ./engine
COPY kernels ./kernels
COPY services ./services
# --no-deps: the operator needs none of the engine's heavy dependencies.
RUN pip install --no-cache-dir --prefix=/install --no-deps . \
 && pip install --no-cache-dir --prefix=/install kopf kubernetes pyyaml

FROM python:3.12-slim
COPY --from=build /install /usr/local
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["python", "-m", "kvmesh.operator"]
