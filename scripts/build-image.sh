#!/bin/sh
# `make image`: build the Dockerfile as IMAGE with the first container engine found (podman,
# buildah, docker; or CONTAINER_ENGINE=...). Fails at once, saying why, when there is none or
# when it cannot build (a docker client without a reachable daemon).
set -eu

image=${1:?usage: $0 IMAGE}
cd "$(dirname "$0")/.."

engine=${CONTAINER_ENGINE:-}
if [ -z "$engine" ]; then
  for candidate in podman buildah docker; do
    if command -v "$candidate" >/dev/null 2>&1; then engine=$candidate; break; fi
  done
fi
if [ -z "$engine" ]; then
  echo "make image: no container engine found: install podman, buildah or docker" \
       "(or set CONTAINER_ENGINE)" >&2
  exit 1
fi
if ! command -v "$engine" >/dev/null 2>&1; then
  echo "make image: container engine '$engine' (CONTAINER_ENGINE) is not installed" >&2
  exit 1
fi

# bounded: a client whose daemon socket never answers must not hang the build
limit=""
command -v timeout >/dev/null 2>&1 && limit="timeout 20"
case "$(basename "$engine")" in
  buildah) probe="version" ;;   # daemonless
  *) probe="info" ;;            # podman: its storage; docker: the daemon
esac
if ! $limit "$engine" $probe >/dev/null 2>&1; then
  echo "make image: '$engine $probe' fails: $engine is installed but cannot build here" \
       "(is its daemon running, or its socket reachable?)" >&2
  exit 1
fi

echo "make image: $engine build -t $image"
exec "$engine" build --tag "$image" --file Dockerfile .
