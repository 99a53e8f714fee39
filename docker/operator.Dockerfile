# kvmesh operator: `python -m kvmesh.operator` (kopf + kubernetes client + pyyaml + prometheus-client, no torch: the
# kvmesh wheel goes in with --no-deps). Runs as uid 65532 with a read-only root filesystem (the
# chart mounts an emptyDir at /tmp). Built by scripts/images.sh (wheels mounted at /wheels).
ARG BASE_IMAGE=localhost/kvmesh/base:bookworm
FROM ${BASE_IMAGE}

ENV PATH=/opt/kvmesh/bin:$PATH \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache

COPY locks/operator.txt /opt/kvmesh-locks/operator.txt
RUN python3 -m venv /opt/kvmesh \
 && /opt/kvmesh/bin/pip install -q --no-index --find-links /wheels --no-deps -r /opt/kvmesh-locks/operator.txt \
 && rm -rf /tmp/* /root/.cache

COPY dist/ /opt/kvmesh-dist/
RUN /opt/kvmesh/bin/pip install -q --no-index --no-deps /opt/kvmesh-dist/kvmesh-*.whl \
 && rm -rf /opt/kvmesh-dist /tmp/* /root/.cache \
 && echo 'nonroot:x:65532:65532:nonroot:/tmp:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'nonroot:x:65532:' >> /etc/group

USER 65532:65532
WORKDIR /tmp
ENTRYPOINT ["python", "-m", "kvmesh.operator"]
