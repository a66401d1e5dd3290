# syntax=docker/dockerfile:1
# gradsync image: one image for the coordinator (the default command), the workers
# (`docker run IMAGE worker --coordinator HOST:PORT --rank R --world-size N`) and the
# coordinator shards (`docker run IMAGE shard --leader HOST:PORT --advertise ME:50051`).
#
# The default command listens on every interface, so it needs a token (protected mode: it
# exits 2 without one). Give it as a file, never on the command line:
#   docker run -v gradsync-token:/var/lib/gradsync \
#       IMAGE token /var/lib/gradsync/token --keep          # once: writes a random token
#   docker run -v gradsync-token:/var/lib/gradsync:ro \
#       -e GRADSYNC_TOKEN_FILE=/var/lib/gradsync/token -p 50051:50051 IMAGE
# Workers and shards read the same variable; add --tls-cert/--tls-key (serve) and
# $GRADSYNC_TLS_CA (workers) across hosts. See SECURITY.md.
#
# Stages: `dependencies` installs torch and the other dependencies into a venv, the builder
# turns the source into a wheel; the default image is the dependencies stage plus the wheel,
# the coordinator image a torch-free venv (`coordinator-dependencies`) plus the wheel, so no
# compiler, pip cache or source tree ships. No stage copies a venv out of another: a
# `COPY --from` of a gigabyte of small files is hashed on every build to look its cache up.
# The default (last) stage is the image above, for every role. `--target coordinator` builds
# a coordinator-only image without torch (the coordinator and the shards never import it:
# their arithmetic is numpy); workers need the default image.
#
# Build argument TORCH_INDEX_URL: the index torch comes from (default: the CPU build's index;
# it and PyPI are all a build on a normal network needs). An extra CA or a local wheel
# directory is given at build time as a mount, never baked in: scripts/container-check.sh
# does that for podman on a machine that reaches neither pytorch.org nor a registry.

FROM python:3.11-slim AS dependencies
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU-only index: the package's `torch>=2.4` is then already met,
# so pip never pulls the CUDA build (gigabytes the coordinator and CPU workers never use).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0
WORKDIR /src
# The dependencies and the extras `demo` (scikit-learn's bundled digits for `gradsync worker`)
# and `redis` (the Redis checkpoint store behind --checkpoint-store redis://...), read from
# pyproject.toml. This venv holds no gradsync code, so a change to the code leaves it (over a
# gigabyte) cached. The default image is built FROM this stage.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = p['optional-dependencies']; \
[print(r) for r in p['dependencies'] + extras['demo'] + extras['redis'] if not r.startswith('torch')]" \
        > /tmp/dependencies.txt \
    && pip install -r /tmp/dependencies.txt

# The wheel, from only what it is built from (client/, server/, proto/, bench/ are the package).
# The build backend pyproject.toml names is installed first, in its own cached layer, so that
# building the wheel of changed code fetches nothing.
FROM dependencies AS builder
RUN python -c "import tomllib; \
[print(r) for r in tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']]" \
        > /tmp/build-requirements.txt \
    && pip install -r /tmp/build-requirements.txt
COPY README.md ./
COPY client client
COPY server server
COPY proto proto
COPY bench bench
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /dist .

# The coordinator's venv: the dependencies with the redis extra, minus torch and the demo
# extra, read from pyproject.toml as the default image's are. It holds no gradsync code, so
# a change to the code leaves it cached; the wheel goes on top in the stage below.
FROM python:3.11-slim AS coordinator-dependencies
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; \
[print(r) for r in p['dependencies'] + p['optional-dependencies']['redis'] if not r.startswith('torch')]" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt /tmp/pyproject.toml

# `--target coordinator`: the coordinator (or a shard) only; the same settings as the default.
FROM coordinator-dependencies AS coordinator
COPY --from=builder /dist /tmp/dist
RUN pip install --no-deps /tmp/dist/gradsync-*.whl && rm -rf /tmp/dist
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PROMETHEUS_DISABLE_CREATED_SERIES=True
RUN useradd --create-home --uid 10001 --user-group gradsync \
    && mkdir -p /var/lib/gradsync && chown gradsync:gradsync /var/lib/gradsync && chmod 700 /var/lib/gradsync
USER gradsync
WORKDIR /home/gradsync
EXPOSE 50051 50052 9100
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "gradsync.healthcheck", "127.0.0.1:50051"]
ENTRYPOINT ["gradsync"]
CMD ["serve", "--world-size", "3", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100"]

# The default image: every role (coordinator, shards, workers).
# The dependencies' venv (cached across code changes), then the small gradsync wheel on top;
# the build's leftovers (its directory, the requirements list) go.
FROM dependencies
COPY --from=builder /dist /tmp/dist
RUN pip install --no-deps /tmp/dist/gradsync-*.whl && rm -rf /tmp/dist /tmp/dependencies.txt /src
# PYTHONUNBUFFERED: logs reach `docker logs` as they are written, not when a buffer fills.
# PROMETHEUS_DISABLE_CREATED_SERIES: no `*_created` series beside every counter/histogram.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PROMETHEUS_DISABLE_CREATED_SERIES=True
RUN useradd --create-home --uid 10001 --user-group gradsync \
    && mkdir -p /var/lib/gradsync && chown gradsync:gradsync /var/lib/gradsync && chmod 700 /var/lib/gradsync
USER gradsync
WORKDIR /home/gradsync
# 50051: the coordinator's (or a shard's) gRPC port; 50052: the coordinator's frame port
# (workers' Sync streams without gRPC's per-message cost, --port + 1 by default; workers find
# it through 50051 and fall back to gRPC without it); 9100: Prometheus metrics (all roles).
EXPOSE 50051 50052 9100
# Our own probe (grpc.health.v1 through grpcio-health-checking, a dependency already): exits 0
# only while the coordinator reports SERVING, so a draining coordinator turns unhealthy.
# Worker containers have no coordinator inside: they must disable this check. The probe sends
# the token of $GRADSYNC_TOKEN_FILE / $GRADSYNC_TOKEN, like every call to a coordinator.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "gradsync.healthcheck", "127.0.0.1:50051"]
ENTRYPOINT ["gradsync"]
CMD ["serve", "--world-size", "3", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100"]
