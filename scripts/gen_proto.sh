#!/usr/bin/env bash
# Regenerate the checked-in Python stubs from proto/gradsync_proto/v1/*.proto.
# The stubs land next to the .proto files, which form the `gradsync_proto.v1`
# package (the protobuf package stays `gradsync.v1`: that name is on the wire).
# No gRPC stubs: the coordinator serves its methods through generic handlers and
# every client calls them by their method name, so only the messages are generated.
# Set PYTHON to pick the interpreter. CI runs this and fails when `git diff` shows drift.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m grpc_tools.protoc -I proto \
  --python_out=proto --pyi_out=proto \
  proto/gradsync_proto/v1/gradsync.proto
