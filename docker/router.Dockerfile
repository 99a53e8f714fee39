# kvmesh router: `kvmesh router --discovery k8s ...`. No torch: it tokenizes with the model's own
# tokenizer through kvmesh.common.model_files, and the embedded model's tokenizer comes converted
# (tokenizers/, made by scripts/images.sh where torch is installed; transformers' GGUF reader, which
# converts a GGUF's vocabulary, imports torch). No nixl. Runs as uid 1000 with a read-only root
# filesystem (/tmp is an emptyDir). Built by scripts/images.sh.
ARG BASE_IMAGE=localhost/kvmesh/base:bookworm
FROM ${BASE_IMAGE}

# KVMESH_CACHE: where model_files finds converted tokenizers (read-only here: the embedded model's).
ENV PATH=/opt/kvmesh/bin:$PATH \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache HF_HOME=/tmp/hf KVMESH_CACHE=/opt/kvmesh-cache

COPY locks/runtime.txt /opt/kvmesh-locks/runtime.txt
# The shared layer: identical to worker.Dockerfile's (keep them in sync: one cached layer for both).
RUN set -eu; \
    command -v python3 >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; }; \
    python3 -m venv /opt/kvmesh; \
    /opt/kvmesh/bin/pip install -q --no-index --find-links /wheels --no-deps -r /opt/kvmesh-locks/runtime.txt; \
    rm -rf /tmp/* /root/.cache

COPY locks/router.txt /opt/kvmesh-locks/router.txt
RUN /opt/kvmesh/bin/pip install -q --no-index --find-links /wheels --no-deps -r /opt/kvmesh-locks/router.txt \
 && rm -rf /tmp/* /root/.cache

COPY tokenizers/ /opt/kvmesh-cache/tokenizers/
COPY dist/ /opt/kvmesh-dist/
RUN /opt/kvmesh/bin/pip install -q --no-index --no-deps /opt/kvmesh-dist/kvmesh-*.whl \
 && rm -rf /opt/kvmesh-dist /tmp/* /root/.cache \
 && echo 'kvmesh:x:1000:1000:kvmesh:/tmp:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'kvmesh:x:1000:' >> /etc/group

USER 1000:1000
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["kvmesh"]
CMD ["router", "--help"]
