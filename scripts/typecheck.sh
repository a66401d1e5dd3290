#!/usr/bin/env bash
# Type-check the `gradsync` package with mypy --strict.
# The package is assembled from client/, server/ and proto/gradsync/v1 by
# setuptools' package-dir mapping, which mypy cannot follow; so lay the same
# package out with symlinks in a scratch folder and check that.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/gradsync"
for file in client/*.py client/py.typed; do ln -s "$root/$file" "$scratch/gradsync/"; done
ln -s "$root/server" "$scratch/gradsync/server"
ln -s "$root/proto/gradsync/v1" "$scratch/gradsync/v1"
cd "$scratch"
"${PYTHON:-python}" -m mypy --config-file "$root/pyproject.toml" -p gradsync
