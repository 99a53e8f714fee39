# Redis for the operator's managed KV connector: Debian bookworm's redis-server, non-root (uid 999),
# no persistence config baked in (the operator passes --save "" --appendonly no --dir /data and
# mounts an emptyDir at /data). Needs the Debian mirror during the build (--network host).
ARG BASE_IMAGE=localhost/kvmesh/base:bookworm
FROM ${BASE_IMAGE}
RUN echo 'redis:x:999:999:redis:/data:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'redis:x:999:' >> /etc/group \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
 && mkdir -p /data && chown 999:999 /data
USER 999:999
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["redis-server"]
CMD ["--save", "", "--appendonly", "no", "--protected-mode", "no", "--bind", "0.0.0.0", "--dir", "/data"]
