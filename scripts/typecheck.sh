#!/usr/bin/env bash
# Type-check every gradsync package with mypy --strict, straight from the tree:
# folders are packages, and pyproject's mypy_path names the source roots. The documentation
# site's hooks (docs/hooks/, loaded by mkdocs as plain files) are checked on their own.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m mypy -p gradsync -p gradsync_proto -p gradsync_server -p gradsync_bench
"${PYTHON:-python}" -m mypy docs/hooks/cli_reference.py docs/hooks/bench_results.py
