"""The documentation site: it builds with `mkdocs build --strict`, a real browser opens it, its
generated pages match the code and the results, and no user-facing text tells work history.

The site is built once per module (`mkdocs build --strict` into tmp_path: a broken link or
anchor, a missing snippet or a bad docstring cross-reference fails it), then served by a
real HTTP server on a free port that records every request's path and status, and opened in
headless Debian Chromium (`/usr/bin/chromium`, package `chromium`; the test skips as a
missing real component without it). A page passes when its DOM holds its own title, the
browser logged no console message (Material for MkDocs logs none; Chromium's log does not
tell console.log from console.error, so any message fails) and nothing it requested was
missing. Chromium's host resolver maps every name but 127.0.0.1 to "not found", so the site
must load nothing from other hosts.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import material  # noqa: F401  (the test extra installs the site's theme and plugin: a missing
import mkdocstrings  # noqa: F401  one is a broken set-up, which must fail, not skip)
import pytest
from support.components import missing

#: One parallel worker runs the whole module: the site is built once (module fixtures).
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("docs-site")]

ROOT = Path(__file__).resolve().parents[2]


def _load_hook(name: str) -> Any:
    """A module of docs/hooks/ (plain files that mkdocs loads by path, as this does)."""
    spec = importlib.util.spec_from_file_location(
        f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHROMIUM = shutil.which("chromium")
NO_CHROMIUM = missing("chromium", "chromium")
#: A reference to a tracker entry or a work session by its number: the pattern the
#: performance page's hook drops from result files (one definition, docs/hooks).
HISTORY: re.Pattern[str] = _load_hook("bench_results").HISTORY
#: The user-facing documents outside docs/ (every docs/**/*.md is checked too).
USER_DOCS = ("README.md", "ARCHITECTURE.md", "SECURITY.md", "deploy/README.md", "bench/README.md")
#: Pages opened in the browser: the home page and deep ones (generated ones included).
PAGES = ("", "diloco/", "reference/cli/", "performance/")
#: Requests a browser makes on its own (not asked for by the page): a 404 there is fine.
BROWSER_OWN = ("/favicon.ico",)
BUILD_TIMEOUT_S = 240
BROWSER_TIMEOUT_S = 60


@dataclass(frozen=True)
class Build:
    """One `mkdocs build --strict` of the repository's site."""

    returncode: int
    output: str
    site: Path


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """Build the site once for the whole module, into a temporary folder."""
    site = tmp_path_factory.mktemp("docs") / "site"
    existed = (ROOT / "site").exists()
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert existed or not (ROOT / "site").exists(), "mkdocs wrote site/ into the repository"
    return Build(result.returncode, result.stdout + result.stderr, site)


@pytest.fixture(scope="module")
def site(build: Build) -> Path:
    """The built site (the test using it fails with mkdocs's output if the build failed)."""
    if build.returncode != 0:
        pytest.fail(f"mkdocs build --strict exited {build.returncode}:\n{build.output}")
    return build.site


def test_site_builds_with_strict_checks(build: Build) -> None:
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.output}"
    for page in ("index.html", "reference/api/index.html", "reference/cli/index.html"):
        assert (build.site / page).is_file(), f"{page} was not built:\n{build.output}"
    # The hook modules are code, not pages.
    assert not (build.site / "hooks").exists()


def test_cli_reference_lists_every_subcommand_and_flag(site: Path) -> None:
    from gradsync.arguments import build_parser

    page = _text(site / "reference/cli/index.html")
    commands = next(
        action.choices
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    for name, subparser in commands.items():
        assert f"gradsync {name}" in page, f"the CLI page lacks `gradsync {name}`"
        for action in subparser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in page, f"the CLI page lacks `gradsync {name} {option}`"
    # A help text as --help expands it, with its default.
    assert "comma-separated subset of" in page
    assert "%(default)" not in page


def test_performance_page_shows_every_result_set(site: Path) -> None:
    page = _text(site / "performance/index.html")
    tables = [ROOT / "bench/results/latest.md", *sorted(ROOT.glob("bench/results/*/latest.md"))]
    assert tables, "no results under bench/results"
    for table in tables:
        document = json.loads(table.with_suffix(".json").read_text())
        where = table.relative_to(ROOT).as_posix()
        assert where in page, f"the performance page does not show {where}"
        assert document["started_at"] in page, f"{where}: its date is not on the page"
        expected = document.get("commit", "not recorded")
        assert expected in page, f"{where}: the page does not say its commit ({expected})"
        plot = table.with_suffix(".png")
        name = plot.parent.name if plot.parent.name != "results" else "all-suites"
        if plot.is_file():
            assert (site / "performance" / f"{name}.png").is_file(), f"{plot} is not on the site"


class _RecordingServer(ThreadingHTTPServer):
    """Serves a folder and remembers every request's path and status, in order."""

    def __init__(self, folder: Path) -> None:
        self.requests: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), partial(_RecordingHandler, directory=str(folder)))

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"


class _RecordingHandler(SimpleHTTPRequestHandler):
    server: _RecordingServer

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        with self.server.lock:
            self.server.requests.append((self.path.split("?")[0], int(code)))

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the test reports what matters."""


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[_RecordingServer]:
    """The built site over real HTTP on a free port."""
    recording = _RecordingServer(site)
    thread = threading.Thread(target=recording.serve_forever, daemon=True)
    thread.start()
    yield recording
    recording.shutdown()
    recording.server_close()
    thread.join(timeout=10)


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_pages_open_in_a_browser_without_errors(
    site: Path, server: _RecordingServer, tmp_path: Path
) -> None:
    failures = []
    for index, page in enumerate(PAGES):
        title = _title(site / page / "index.html")
        with server.lock:
            first = len(server.requests)
        # A fresh profile per page: nothing comes from the browser's cache.
        returncode, dom, log = _chromium(server.url + page, tmp_path / f"profile-{index}")
        with server.lock:
            requests = server.requests[first:]
        console = [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
        broken = [(path, status) for path, status in requests if status >= 400]
        broken = [(path, status) for path, status in broken if path not in BROWSER_OWN]
        if returncode != 0:
            failures.append(f"/{page}: chromium exited {returncode}:\n{log[-3000:]}")
        if (f"/{page}", 200) not in requests:
            failures.append(f"/{page}: not served with 200 (requests: {requests})")
        if html.escape(title, quote=False) not in dom:
            failures.append(f"/{page}: the page's title {title!r} is not in the browser's DOM")
        if console:
            failures.append(f"/{page}: console messages:\n" + "\n".join(console))
        if broken:
            failures.append(f"/{page}: requests that failed: {broken}")
        if not any(path.endswith(".js") and status == 200 for path, status in requests):
            failures.append(f"/{page}: the browser loaded no script (requests: {requests})")
    assert not failures, "\n".join(failures)


def test_no_user_facing_doc_tells_work_history(site: Path) -> None:
    sources = [ROOT / name for name in USER_DOCS] + sorted((ROOT / "docs").rglob("*.md"))
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group()!r} in {line.strip()[:120]!r}"
        for path in sources
        if path.is_file()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in HISTORY.finditer(line)
    ]
    # The built pages, generated ones included (CLI help, results, API docstrings).
    found += [
        f"site/{page.relative_to(site)}: {match.group()!r} in "
        f"{text[max(0, match.start() - 60) : match.end() + 60]!r}"
        for page in sorted(site.rglob("*.html"))
        for text in [_text(page)]
        for match in HISTORY.finditer(text)
    ]
    assert not found, "history in user-facing docs:\n" + "\n".join(found)


def _chromium(url: str, profile: Path) -> tuple[int, str, str]:
    """Open `url` in headless Chromium: (exit status, the DOM after scripts ran, its log)."""
    assert CHROMIUM is not None
    command = [
        CHROMIUM,
        "--headless=new",
        "--no-sandbox",  # as root, and in containers without user namespaces
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        # Nothing but the test's server resolves: the site must not need other hosts.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--enable-logging=stderr",
        "--v=0",
        # Let the page's scripts (and the timers they start) run before the DOM is taken.
        "--virtual-time-budget=3000",
        "--dump-dom",
        url,
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its helper processes go with it on a timeout
    )
    try:
        dom, log = process.communicate(timeout=BROWSER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        dom, log = process.communicate()
        return -1, dom, log + f"\n(killed after {BROWSER_TIMEOUT_S} s)"
    return process.returncode, dom, log


def _title(page: Path) -> str:
    """The text of a built page's <title> (Material: "Page - gradsync", or the site's name)."""
    match = re.search(r"<title>(.*?)</title>", page.read_text(encoding="utf-8"), re.DOTALL)
    assert match, f"{page} has no <title>"
    return html.unescape(match.group(1).strip())


def _text(page: Path) -> str:
    """A built page's visible text, roughly: tags, scripts and styles out, entities decoded."""
    source = page.read_text(encoding="utf-8")
    source = re.sub(r"<(script|style)\b.*?</\1>", " ", source, flags=re.DOTALL | re.IGNORECASE)
    return html.unescape(" ".join(re.sub(r"<[^>]+>", " ", source).split()))
