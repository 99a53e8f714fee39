# kvmesh worker (prefill or decode role): CUDA runtime + torch + the engine. The operator runs
# it as `kvmesh serve --role prefill|decode ...` as uid 1000 with a read-only root filesystem.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvmesh
ENV PATH=/opt/kvmesh/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HF_HOME=/tmp/hf TRITON_CACHE_DIR=/tmp/triton
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir ".[serve]" && rm -rf /src
RUN useradd --uid 1000 --create-home kvmesh
USER 1000:1000
WORKDIR /home/kvmesh
EXPOSE 8000 5557 5600
ENTRYPOINT ["kvmesh"]
CMD ["serve", "--help"]
