#!/bin/sh
# The container image's install recipe, shared by the Dockerfile and tests/test_image.py (which
# runs these same two steps without a container engine), so the test proves what the image holds.
#
#   scripts/image-install.sh wheel SRC OUT    build the product wheel from the checkout SRC into OUT
#   scripts/image-install.sh install VENV WHEEL_DIR
#                                             create the venv VENV (no system site packages, no
#                                             pip or setuptools in it) and install that wheel and
#                                             its runtime dependencies only, with $PYTHON's pip
#
# The product wheel holds xds_server and weight_calculator with their package data (the status
# page's static files) and NOT trimtab_dev: the simulator, load generator, bench and demos are
# development tools the product never imports (tests/test_imports.py). pyproject.toml keeps
# trimtab_dev in its package list because `pip install -e '.[dev]'` (make venv) needs it there,
# so this recipe builds from a staged copy of the product's sources only. The wheel keeps the
# `trimtab.commands` entry points; `trimtab` offers none whose package is not installed.
# Building in a staged copy also leaves no build/ or *.egg-info in SRC.
set -eu

PRODUCT_FILES="pyproject.toml README.md xds_server weight_calculator"

usage() {
  echo "usage: $0 wheel SRC OUT | install VENV WHEEL_DIR" >&2
  exit 2
}

[ $# -eq 3 ] || usage
python="${PYTHON:-python3}"

case "$1" in
  wheel)
    src=$2 out=$3
    stage=$(mktemp -d "${TMPDIR:-/tmp}/trimtab-wheel.XXXXXX")
    trap 'rm -rf "$stage"' EXIT
    for f in $PRODUCT_FILES; do
      cp -R "$src/$f" "$stage/"
    done
    find "$stage" -name __pycache__ -type d -prune -exec rm -rf {} +
    mkdir -p "$out"
    # build isolation: setuptools and wheel as pyproject's [build-system] asks, from the index
    "$python" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$out" "$stage"
    ;;
  install)
    venv=$2 wheels=$3
    "$python" -m venv --without-pip "$venv"
    # exactly one trimtab wheel; its [project] dependencies, no extras
    set -- "$wheels"/trimtab-*.whl
    [ $# -eq 1 ] && [ -f "$1" ] || { echo "$0: want one trimtab wheel in $wheels, found: $*" >&2; exit 1; }
    "$python" -m pip --python "$venv/bin/python" install --quiet --disable-pip-version-check \
      --no-warn-script-location "$1"
    ;;
  *)
    usage
    ;;
esac
