# trimtab's container image: `make image` builds it as ghcr.io/trimtab/trimtab:<pyproject version>,
# the image deploy/base/trimtab.yaml runs (deploy/README.md: building and pushing it).
#
# * Only the product: the trimtab wheel (xds_server, weight_calculator, the status page's static
#   files) and its [project] dependencies, in the venv /opt/trimtab. No dev extras, no
#   trimtab_dev (simulator, load generator, bench, demos), no pip or setuptools in the venv.
#   scripts/image-install.sh is the recipe; tests/test_image.py runs the same two steps
#   without a container engine and checks what they install.
# * Non-root: uid/gid 65532, as deploy/'s runAsUser and fsGroup.
# * Read-only root filesystem: the .pyc files are compiled at build time and Python writes
#   no more (PYTHONDONTWRITEBYTECODE). The one writable path trimtab may need is /tmp
#   (HOME and TMPDIR point there): mount an emptyDir or tmpfs there, as deploy/ does. A
#   rollouts.state_file (rollouts without coordination.kubernetes) must name a writable volume.
# * No HEALTHCHECK: Kubernetes probes /healthz and /readyz on the admin port.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY scripts/image-install.sh scripts/image-install.sh
COPY pyproject.toml README.md ./
COPY xds_server xds_server
COPY weight_calculator weight_calculator
RUN PYTHON=python scripts/image-install.sh wheel /src /wheels
RUN PYTHON=python scripts/image-install.sh install /opt/trimtab /wheels

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 65532 trimtab \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin trimtab
COPY --from=build /opt/trimtab /opt/trimtab
ENV PATH=/opt/trimtab/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp
USER 65532:65532
WORKDIR /tmp
# xDS (ADS, gRPC), admin API and status page (HTTP), KEDA external scaler (gRPC, when
# keda.address is set): the ports deploy/'s config binds on 0.0.0.0
EXPOSE 18000 19100 19200
ENTRYPOINT ["trimtab"]
CMD ["serve", "--config", "/etc/trimtab/trimtab.yaml"]
