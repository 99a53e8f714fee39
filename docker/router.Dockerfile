# kvmesh router: `kvmesh router --discovery k8s ...`. It tokenizes with the model's own tokenizer,
# read through kvmesh.common.model_files, which imports no torch; but a GGUF's vocabulary becomes that
# tokenizer (once, then cached) through transformers' GGUF reader, which imports torch: so the image
# still carries the same torch runtime layer as the CPU worker (shared in storage), but no nixl.
# Runs as uid 1000 with a read-only root filesystem (/tmp is an emptyDir). Built by scripts/images.sh.
ARG BASE_IMAGE=localhost/kvmesh/base:bookworm
FROM ${BASE_IMAGE}

ENV PATH=/opt/kvmesh/bin:$PATH \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache HF_HOME=/tmp/hf TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor MPLCONFIGDIR=/tmp/matplotlib NUMBA_CACHE_DIR=/tmp/numba

ARG TORCH_VARIANT=cpu
COPY locks/runtime.txt /opt/kvmesh-locks/runtime.txt
# Identical to worker.Dockerfile's runtime step (keep them in sync: one cached layer for both).
RUN set -eu; \
    command -v python3 >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; }; \
    python3 -m venv /opt/kvmesh; \
    req=/opt/kvmesh-locks/runtime.txt; \
    if [ "$TORCH_VARIANT" = cpu ]; then \
      grep -viE '^(triton|nvidia-cusolver|nvidia-cuda-nvrtc|nvidia-nvtx|cuda-bindings|cuda-pathfinder|cuda-toolkit)==' \
        "$req" > /tmp/req.txt; req=/tmp/req.txt; fi; \
    /opt/kvmesh/bin/pip install -q --no-index --find-links /wheels --no-deps -r "$req"; \
    if [ "$TORCH_VARIANT" = cpu ]; then \
      sp=$(echo /opt/kvmesh/lib/python3*/site-packages); \
      rm -f $sp/nvidia/cudnn/lib/libcudnn_*.so.9 $sp/nvidia/cu13/lib/*.a $sp/nvidia/cu13/lib/libnvperf* \
            $sp/nvidia/cu13/lib/libcusolverMg* $sp/nvidia/cu13/lib/libnvblas* $sp/nvidia/cu13/lib/libcufftw* \
            $sp/nvidia/nvshmem/lib/*.a $sp/nvidia/nvshmem/lib/*.bc $sp/nvidia/nvshmem/lib/nvshmem_transport_*; \
    fi; \
    rm -rf /tmp/* /root/.cache

COPY locks/router.txt /opt/kvmesh-locks/router.txt
RUN /opt/kvmesh/bin/pip install -q --no-index --find-links /wheels --no-deps -r /opt/kvmesh-locks/router.txt \
 && rm -rf /tmp/* /root/.cache

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
