# kvmesh router: CPU only (no torch CUDA wheels). Run as `kvmesh router --discovery k8s ...`.
FROM python:3.12-slim
# Point this at a CPU-only torch wheel index to keep the image small.
ARG PIP_EXTRA_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir ".[serve]" \
 && pip install --no-cache-dir kubernetes && rm -rf /src
RUN useradd --uid 1000 --create-home kvmesh
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvmesh"]
CMD ["router", "--help"]
