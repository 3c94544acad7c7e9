"""report.html in a real browser: Debian's Chromium driven by Playwright (no
browser is downloaded), for real gloo jobs of each kind (a hang, a NaN, a
straggler, a healthy run), opened from file:// with every network request
refused; and the live page of a running job on its collector, refused
without the credential and shown with the one-time link `rankwatch run`
printed.

Each page: no console error, no request leaves the file, and what a person
looks for is on screen (the culprit rank, the stuck source line, the first
sequence number where the ranks part). A screenshot of each is kept under the
test's tmp dir (RANKWATCH_SCREENSHOTS=DIR keeps copies there too).

Without Chromium or Playwright these tests skip, saying why; with CI (or
RANKWATCH_REQUIRE_BROWSER=1) set they fail instead: .ci/run installs Debian's
chromium and requires them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import TRAIN, run_job, wait_until, worker_env

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install -e '.[dev]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    return None


@pytest.fixture(scope="module")
def browser():
    missing = _missing()
    if missing:
        if os.environ.get("CI") or os.environ.get("RANKWATCH_REQUIRE_BROWSER"):
            pytest.fail(f"the page tests need a browser here: {missing}")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("screenshots")


class Visit:
    """A browser tab that records console errors, page errors and requests."""

    def __init__(self, browser, offline: bool):
        self.context = browser.new_context(viewport={"width": 1360, "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.refused: list[str] = []  # answers of 400 and more (an expected 401 or 403 too)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("response", lambda r: self.refused.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        if offline:
            self.page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                            else route.abort())

    def open_file(self, path: Path):
        self.page.goto(path.as_uri(), wait_until="load")
        self.wait_ready()
        return self.page

    def wait_ready(self, timeout_ms: int = 20_000) -> None:
        """Until the page's script has drawn it; a timeout says what the page
        showed instead, its errors and its refused requests."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.page.wait_for_selector("html[data-rw-ready]", state="attached", timeout=timeout_ms)
        except PlaywrightTimeout:
            try:
                shown = f"{self.page.title()!r}: {self.page.locator('body').inner_text(timeout=2_000)[:600]!r}"
            except Exception as exc:
                shown = f"(unreadable: {type(exc).__name__}: {exc})"
            raise AssertionError(f"the page at {self.page.url} was not ready after {timeout_ms / 1000:.0f} s; "
                                 f"it shows {shown}; errors {self.errors}; refused {self.refused}") from None

    def shot(self, folder: Path, name: str) -> Path:
        path = folder / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        keep = os.environ.get("RANKWATCH_SCREENSHOTS")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(keep) / path.name)
        return path

    def close(self):
        self.context.close()


def _check_offline_page(visit: Visit, job) -> None:
    page = visit.page
    assert not visit.errors, visit.errors
    assert all(u.startswith("file:") for u in visit.requests), visit.requests
    assert page.locator(".uplot canvas").count() >= 1, "the timelines were drawn"
    assert page.locator("#rw-hm").is_visible()
    for v in job.report["verdicts"]:  # the same facts as report.json
        assert page.get_by_text(v["summary"][:60], exact=False).first.is_visible()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """One real job per kind, made once for the module."""
    made = {}

    def job(kind: str):
        if kind not in made:
            tmp = tmp_path_factory.mktemp(kind)
            args = {
                "hang": ["--nproc-per-node", "3", "--hang-timeout", "8", str(TRAIN), "--steps", "40",
                         "--fault", "hang", "--fault-rank", "1", "--fault-step", "6"],
                "nan": ["--nproc-per-node", "2", str(TRAIN), "--steps", "14", "--fault", "nan",
                        "--fault-rank", "1", "--fault-step", "6"],
                "straggler": ["--nproc-per-node", "2", str(TRAIN), "--steps", "60", "--fault", "slow",
                              "--fault-rank", "1", "--fault-step", "0", "--fault-size", "120"],
                "healthy": ["--nproc-per-node", "2", str(TRAIN), "--steps", "16"],
            }[kind]
            made[kind] = run_job(tmp, args)
            assert (made[kind].run_dir / "report.html").is_file(), made[kind].output[-3000:]
        return made[kind]

    return job


def test_a_hangs_page_shows_the_culprit_its_line_and_where_the_ranks_part(browser, jobs, shots):
    job = jobs("hang")
    hang = job.only("hang")
    assert hang["ranks"] == [1]
    visit = Visit(browser, offline=True)
    try:
        page = visit.open_file(job.run_dir / "report.html")
        card = page.locator("article.verdict.kind-hang")
        assert card.locator(".culprits").inner_text() == "rank 1"
        line = re.search(r"train\.py:(\d+) in main", hang["summary"]).group(0)
        stuck = card.locator(".stack-group.culprit .stuck-line").first
        assert stuck.is_visible() and stuck.inner_text() == line.split(" in ")[0]
        assert "time.sleep(3600)" in card.locator(".stack-group.culprit pre.source-line").first.inner_text()
        parting = card.locator(".parting-seq").first
        assert parting.is_visible() and parting.inner_text() == f"#{hang['evidence']['waiting_at']['0']}"
        behind = card.locator("table.align tr.behind")
        assert behind.count() == 1 and behind.first.locator("td").first.inner_text() == "rank 1"
        assert card.locator(".stack-group.common .ranks").first.inner_text() == "ranks 0, 2"
        _check_offline_page(visit, job)
        visit.shot(shots, "hang")
    finally:
        visit.close()


def test_a_nan_page_names_the_origin_rank(browser, jobs, shots):
    job = jobs("nan")
    nonfinite = job.only("nonfinite")
    visit = Visit(browser, offline=True)
    try:
        page = visit.open_file(job.run_dir / "report.html")
        card = page.locator("article.verdict.kind-nonfinite")
        assert card.locator(".culprits").inner_text() == f"rank {nonfinite['ranks'][0]}"
        assert card.locator(".facts .step").inner_text() == str(nonfinite["step"])
        assert card.locator("table.per-rank tr.culprit").count() >= 1
        assert page.locator('figure.chart[data-metric="loss"] .uplot').count() == 1
        _check_offline_page(visit, job)
        visit.shot(shots, "nan")
    finally:
        visit.close()


def test_a_stragglers_page_names_the_slow_rank(browser, jobs, shots):
    job = jobs("straggler")
    straggler = job.only("straggler")
    visit = Visit(browser, offline=True)
    try:
        page = visit.open_file(job.run_dir / "report.html")
        card = page.locator("article.verdict.kind-straggler")
        assert card.locator(".culprits").inner_text() == f"rank {straggler['ranks'][0]}"
        assert card.locator("table.per-rank tr.culprit td.rank").first.inner_text() == str(straggler["ranks"][0])
        assert page.locator('figure.chart[data-metric="compute_s"] .uplot').count() == 1
        _check_offline_page(visit, job)
        visit.shot(shots, "straggler")
    finally:
        visit.close()


def test_a_healthy_page_says_healthy(browser, jobs, shots):
    job = jobs("healthy")
    assert job.report["status"] == "healthy"
    visit = Visit(browser, offline=True)
    try:
        page = visit.open_file(job.run_dir / "report.html")
        assert page.locator("#rw-status").inner_text() == "HEALTHY"
        assert page.get_by_text("No faults found: 2 ranks").is_visible()
        assert page.locator("article.verdict:not(.healthy-card)").count() == 0
        _check_offline_page(visit, job)
        visit.shot(shots, "healthy")
    finally:
        visit.close()


def test_the_live_page_of_a_running_job_needs_the_printed_link(browser, tmp_path, shots):
    """A hung job left running (--on-hang wait) with its embedded collector:
    the page refuses a browser without the credential; the one-time link that
    `rankwatch run` printed opens it at the clean URL, and the page shows the
    hang when the verdict comes, without a reload."""
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(tmp_path / "run"), "--on-hang", "wait",
           "--hang-timeout", "8", "--nproc-per-node", "2", str(TRAIN), "--steps", "200", "--fault", "hang",
           "--fault-rank", "1", "--fault-step", "8"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(l) for l in proc.stdout], daemon=True)
    reader.start()
    try:
        link_line = wait_until(lambda: next((l for l in lines if "[rankwatch] page: http" in l), None), 90,
                               what="the printed page link")
        link = re.search(r"(http://\S+/login/\S+)", link_line).group(1)
        run_id = re.search(r"\[rankwatch\] run (\S+):", "".join(lines)).group(1)
        base = link.split("/login/")[0]
        # Without the credential: refused, nothing of the run shown.
        stranger = Visit(browser, offline=False)
        try:
            response = stranger.page.goto(f"{base}/runs/{run_id}")
            assert response.status == 401
            assert stranger.page.get_by_text("This page needs a rankwatch link").is_visible()
            assert run_id not in stranger.page.content()
            assert stranger.page.goto(f"{base}/v1/runs/{run_id}/page").status == 401
        finally:
            stranger.close()
        visit = Visit(browser, offline=False)
        try:
            visit.page.goto(link)
            visit.page.wait_for_url(f"{base}/runs/{run_id}", timeout=10_000)  # the code is left behind
            visit.wait_ready()
            assert visit.page.locator("#rw-live").is_visible()
            card = visit.page.locator("article.verdict.kind-hang .culprits")
            card.wait_for(timeout=60_000)  # the live page refreshes until the verdict is there
            assert card.inner_text() == "rank 1"
            assert visit.page.locator(".stack-group.culprit .stuck-line").first.is_visible()
            assert visit.page.locator(".parting-seq").first.is_visible()
            assert not visit.errors, visit.errors
            assert all(u.startswith(base) for u in visit.requests), visit.requests
            visit.shot(shots, "live-hang")
            # The link was for one use: a second browser cannot use it again.
            again = Visit(browser, offline=False)
            try:
                assert again.page.goto(link).status == 403
                assert again.page.goto(f"{base}/runs/{run_id}").status == 401
            finally:
                again.close()
        finally:
            visit.close()
        token = re.search(r"RANKWATCH_TOKEN=(\S+)", "".join(lines))
        assert token is None  # the launcher never prints its token
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    assert (tmp_path / "run" / "report.html").is_file(), "".join(lines)[-3000:]


def test_sampled_series_points_and_the_bundle_column_in_view(browser, shots, tmp_path):
    """Issue 26 in the real browser: a sampled series' chart says it is
    sampled and has points drawn (non-blank canvas); the evidence table's
    bundle column is in view without scrolling sideways; a rank's switch to
    eval is marked on the timelines and listed; no script error."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import page_load

    from rankwatch import wire
    from rankwatch.outputs import html

    run, _ = page_load.synthetic(4, culprit=2)
    for state in run.ranks.values():
        for step, record in state.steps.items():
            record.grad_norm = 1.0 + (step % 5) * 0.1 if step % 8 == 0 else None
    path = "/very/long/run/dir/bundles/collective_mismatch-1/rank-00002.tar.gz"
    evidence = {"calls": {str(r): {"op": "all_reduce", "callsite": "a/very/long/path/to/the/training/script.py:40 "
                                   "in a_function_with_a_long_name", "numel": 1 << (r * 8)} for r in range(4)},
                "others": {str(r): {"phase": "backward", "step": 5} for r in (0, 1, 3)},
                "peers": {str(r): {"sequence": 12, "op": "allreduce", "input_sizes": [[1024, 1024]] * 4,
                                   "origin": "internal"} for r in (0, 1, 3)},
                "bundles": {str(r): path.replace("00002", f"{r:05d}") for r in range(4)}}
    report = wire.Report(run_id=run.run_id, world_size=4, status="faulty", verdicts=[wire.Verdict(
        kind="collective_mismatch", ranks=[2], step=5, first_seen_at="2026-11-24T10:00:00.000Z",
        detected_at="2026-11-24T10:00:03.500Z", summary="Rank 2 called all_reduce.", evidence=evidence)])
    # Issue 26 item 5: rank 2 switching to eval is a dotted mark on its timelines.
    steps = sorted(run.ranks[2].steps)
    for step, facts in ((steps[0], [["mode", "train"]]), (steps[len(steps) // 2], [["mode", "eval"]])):
        run.ranks[2].events.append(wire.Event(kind="train_config", at=1.0 + step, step=step, details={
            "facts": facts, "sites": [["mode", "train.py:88"]]}))
    target = tmp_path / "report.html"
    target.write_text(html.page(report, run))
    visit = Visit(browser, offline=True)
    try:
        page = visit.open_file(target)
        assert "rank 2 at step" in page.locator("details.config-changes").text_content()
        marked = page.evaluate("""() => {  // the mark's colour (#2f4f4f) on the loss chart
            const c = document.querySelector('figure.chart[data-metric="loss"] canvas');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) {
                if (d[i + 3] > 200 && Math.abs(d[i] - 47) < 10 && Math.abs(d[i + 1] - 79) < 10 &&
                    Math.abs(d[i + 2] - 79) < 10) n++;
            }
            return n; }""")
        assert marked > 20, marked
        caption = page.locator('figure.chart[data-metric="grad_norm"] figcaption')
        assert "sampled" in caption.inner_text()
        # Points drawn: the plot's canvas has coloured pixels beyond the axes' grey.
        coloured = page.evaluate("""() => {
            const c = document.querySelector('figure.chart[data-metric="grad_norm"] canvas');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) {
                const [r, g, b, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
                if (a > 0 && (Math.max(r, g, b) - Math.min(r, g, b)) > 60) n++;
            }
            return n; }""")
        assert coloured > 50
        header = page.locator("table.per-rank th", has_text="bundles").first
        box = header.bounding_box()
        assert box is not None and box["x"] + box["width"] <= 1360, box
        assert not visit.errors, visit.errors
        visit.shot(shots, "sampled-and-bundles")
    finally:
        visit.close()
