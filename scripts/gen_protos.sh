#!/usr/bin/env bash
# Regenerate the committed KEDA external-scaler stubs from protos/externalscaler.proto.
# Usage: scripts/gen_protos.sh [OUTPUT_DIR]   (default: xds_server/keda)
# Needs grpcio-tools (`pip install grpcio-tools`); PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
OUT="${1:-xds_server/keda}"
mkdir -p "$OUT"
"$PYTHON" -m grpc_tools.protoc -I protos \
    --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
    protos/externalscaler.proto
# protoc writes `import externalscaler_pb2 as ...`, which only works with OUT on sys.path;
# make it a relative import so the stubs work as part of the xds_server.keda package.
sed -i.bak 's/^import externalscaler_pb2 as /from . import externalscaler_pb2 as /' \
    "$OUT/externalscaler_pb2_grpc.py"
rm -f "$OUT/externalscaler_pb2_grpc.py.bak"
# Generated code is not ours to lint.
for f in "$OUT"/externalscaler_pb2.py "$OUT"/externalscaler_pb2.pyi "$OUT"/externalscaler_pb2_grpc.py; do
    { echo "# ruff: noqa"; cat "$f"; } > "$f.tmp" && mv "$f.tmp" "$f"
done
