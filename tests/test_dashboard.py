"""The web dashboard in real headless Chromium (Debian's /usr/bin/chromium driven by Playwright)
against a real service with seeded records. Screenshots go to test-artifacts/dashboard/."""

from __future__ import annotations

import logging
import os
import shutil
import time

import httpx
import pytest

from ckptstore.client.service.rest import ServiceClient
from ckptstore.copykey import CopyKey
from ckptstore.position import Position
from ckptstore.report import AccessReport
from ckptstore.wire.schema import ForkPoint, PositionBody, ResumeAudit, SkippedCopy
from tests.builders import commit_body
from tests.conftest import service_settings
from tests.live import LiveService

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "test-artifacts", "dashboard")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOKEN = "dashboard-token-5f1c9a"
HOSTILE = "<script>window.__pwned = 1</script> EndpointConnectionError"


def commit(
    url: str, token: str | None, root: str, job: str, node: str, position: Position, attempt: int, tier: str = "durable"
) -> None:
    """Record a commit (the dashboard reads records only: no bytes need to be on storage)."""
    body = commit_body(root, job, node, position.epoch, position.batch, attempt, bytes=4096, tier=tier)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.post(f"{url}/v1/jobs/{job}/nodes/{node}/checkpoints", json=body, headers=headers, timeout=10)
    assert response.status_code == 201, response.text


def seed(url: str, root: str, token: str | None = None) -> None:
    """Job `demo` (n0, n1, n2; epochs 0–5): n1's epoch 4 corrupt, n2's epoch 5 missing, n0's epoch 0
    deleted, n2's storage failing with a hostile error text; job `long` with 130 positions."""
    with ServiceClient(url, token=token) as client:
        client.put_job("demo", ["n0", "n1", "n2"], storage_root=root)
        attempts = {}
        for node in ("n0", "n1", "n2"):
            attempt = attempts[node] = client.start_attempt("demo", node)
            for epoch in range(6):
                if (node, epoch) != ("n2", 5):
                    commit(url, token, root, "demo", node, Position(epoch), attempt)
                    client.report_stats("demo", node, "save", 0.1 + epoch / 10, nbytes=4096)
        client.mark(
            CopyKey("demo", "n1", Position(4), attempts["n1"]), "corrupt", cause="verify", reason=f"verify: {HOSTILE}"
        )
        client.mark(
            CopyKey("demo", "n0", Position(0), attempts["n0"]), "deleted", cause="retention", reason="retention"
        )
        client.report_health("demo", "n2", AccessReport(False, None, HOSTILE))
        client.report_health("demo", "n0", AccessReport(True, 2.5, None))
        client.report_health("demo", "n1", AccessReport(True, 3.1, None))
        seed_tiers(client, url, token, root)
        seed_history(client, url, token, root)
        client.put_job(
            "demo-lr", ["n0"], storage_root=root, parent=ForkPoint(job="demo", position=PositionBody(epoch=3))
        )
        # demo-lr-2 forks demo-lr at 1.b20: a good position of demo-lr (a fork starts from one)
        commit(url, token, root, "demo-lr", "n0", Position(1, 20), client.start_attempt("demo-lr", "n0"))
        client.put_job(
            "demo-lr-2",
            ["n0"],
            storage_root=root,
            parent=ForkPoint(job="demo-lr", position=PositionBody(epoch=1, batch=20)),
        )
        client.put_job("long", ["solo"], storage_root=root)
        attempt = client.start_attempt("long", "solo")
        for epoch in range(65):
            commit(url, token, root, "long", "solo", Position(epoch, 50), attempt)
            commit(url, token, root, "long", "solo", Position(epoch), attempt)


LOCAL_ROOT = "/local-ssd/ckpt"


def seed_tiers(client: ServiceClient, url: str, token: str | None, root: str) -> None:
    """Job `tiered` (t0, t1 with a local tier): epochs 0–3 local, 0–1 replicated; t1's epoch 3 local
    copy corrupt; a restart that skipped it."""
    client.put_job("tiered", ["t0", "t1"], storage_root=root, local_root=LOCAL_ROOT)
    for node in ("t0", "t1"):
        attempt = client.start_attempt("tiered", node)
        for epoch in range(4):
            commit(url, token, LOCAL_ROOT, "tiered", node, Position(epoch), attempt, tier="local")
            if epoch < 2:
                commit(url, token, root, "tiered", node, Position(epoch), attempt, tier="durable")
    reason = "restore: shard tensors-00000.safetensors does not match its checksum (tensors ['dense/kernel'])"
    client.mark(CopyKey("tiered", "t1", Position(3), attempt, "local"), "corrupt", cause="restore", reason=reason)
    restart = client.start_attempt("tiered", "t1")
    skipped = SkippedCopy(epoch=3, attempt="1", tier="local", state="corrupt", reason=reason)
    client.report_resume("tiered", "t1", restart, resumed_from=Position(2), skipped=[skipped])
    drift = ["optimizer: saved Adam, restoring into AdamW"]
    audit = ResumeAudit(position=PositionBody.of(Position(2)), verdict="drift", differences=drift)
    client.report_audit("tiered", "t1", restart, audit)


def seed_history(client: ServiceClient, url: str, token: str | None, root: str) -> None:
    """Job `advised` (node a0): 14 epochs and 4 starts — 3 failures, each redoing 600 s of work —,
    every save blocking training 2 s. `lay_out_history` then spreads it over 8,400 s."""
    client.put_job("advised", ["a0"], storage_root=root)
    attempt = client.start_attempt("advised", "a0")
    for epoch in range(14):
        if epoch in (5, 8, 11):
            attempt = client.start_attempt("advised", "a0")
            client.report_resume("advised", "a0", attempt, resumed_from=Position(epoch - 1), skipped=[])
        commit(url, token, root, "advised", "a0", Position(epoch), attempt)
        client.report_stats("advised", "a0", "blocked", 2.0, nbytes=0)


def lay_out_history(database: str) -> None:
    """Timestamps of job `advised`, set by SQL: epoch e committed at 600·(e+1) s, each save's report
    with it; the restarts at 3,600, 5,400 and 7,200 s, each 600 s after the commit it resumed from."""
    import sqlite3

    base = time.time() - 9000
    with sqlite3.connect(database) as db:
        job = db.execute("SELECT id FROM jobs WHERE name = 'advised'").fetchone()[0]
        db.execute("UPDATE checkpoints SET created_at = ? + 600 * (epoch + 1) WHERE job_id = ?", (base, job))
        starts = {1: 0, 2: 3600, 3: 5400, 4: 7200}
        for number, at in starts.items():
            db.execute("UPDATE attempts SET started_at = ? WHERE job_id = ? AND number = ?", (base + at, job, number))
        rows = [r[0] for r in db.execute("SELECT rowid FROM stats WHERE job_id = ? ORDER BY rowid", (job,))]
        for i, rowid in enumerate(rows):
            db.execute("UPDATE stats SET created_at = ? WHERE rowid = ?", (base + 600 * (i + 1), rowid))


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail("Chromium is not installed: scripts/test.sh installs Debian's chromium and chromium-driver")
    os.makedirs(ARTIFACTS, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def start(tmp_path, **overrides) -> LiveService:
    live = LiveService(service_settings(str(tmp_path), f"sqlite:///{tmp_path}/ui.db", **overrides))
    seed(live.url, live.settings.default_storage, token=overrides.get("token"))
    lay_out_history(f"{tmp_path}/ui.db")
    return live


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    live = start(tmp_path_factory.mktemp("dashboard"))
    yield live
    live.stop()


def cell(page, node: str, position: str):
    return page.locator(f'td.cell[data-node="{node}"][data-position="{position}"]')


def test_jobs_page_then_job_page_show_the_seeded_states(browser, service):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.goto(service.url + "/")
    assert page.url.endswith("/ui/"), "/ redirects to the jobs page"
    row = page.locator('tr[data-job="demo"]')
    cells = row.locator("td").all_inner_texts()
    assert cells[:5] == ["demo", "3", "3", "3", "5"], cells
    assert "1 epoch (n2)" in cells[5] and "1 failing" in cells[6]
    page.screenshot(path=os.path.join(ARTIFACTS, "jobs.png"), full_page=True)
    row.locator("a").click()
    page.wait_for_url("**/ui/jobs/demo")
    assert page.locator("#last-good").inner_text() == "3"
    assert page.locator("#resume").inner_text() == "3"
    expected = {("n1", "4"): ("corrupt", "✗"), ("n2", "5"): ("missing", "?"), ("n0", "0"): ("deleted", "⌫")}
    expected |= {("n0", "3"): ("committed", "✓"), ("n2", "4"): ("committed", "✓")}
    for (node, position), (state, symbol) in expected.items():
        located = cell(page, node, position)
        assert (located.get_attribute("data-state"), located.inner_text()) == (state, symbol), (node, position)
    assert "corrupt" in cell(page, "n1", "4").get_attribute("title")
    header = page.locator("th.pos.last-good")
    assert header.count() == 1 and "3" in header.inner_text() and "★" in header.inner_text()
    assert "15 committed, 1 missing, 1 corrupt, 1 deleted" in page.locator(".counts").inner_text()
    assert page.locator("svg polyline").count() == 3, "size, save-time and goodput plots"
    assert page.locator("table.attempts tbody tr").count() == 3
    assert page.locator("#children").inner_text() == "demo-lr (at 3)", "the jobs forked from it"
    page.screenshot(path=os.path.join(ARTIFACTS, "job.png"), full_page=True)
    page.goto(service.url + "/ui/jobs/demo-lr-2")
    assert page.locator("#parent").inner_text() == "demo-lr@1.b20 ← demo@3", "the ancestry, nearest first"
    page.locator("#parent a").last.click()
    page.wait_for_url("**/ui/jobs/demo")
    page.goto(service.url + "/ui/jobs/demo")
    page.get_by_text("← all jobs").click()
    page.wait_for_url("**/ui/")
    page.close()


def test_the_job_page_shows_tiers_replication_lag_and_skipped_copies(browser, service):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.goto(service.url + "/ui/jobs/tiered")
    assert page.locator("#durable").inner_text() == "1" and page.locator("#last-good").inner_text() == "2"
    assert LOCAL_ROOT in page.content()
    pending = cell(page, "t0", "3")
    assert pending.get_attribute("data-state") == "committed" and "local-only" in pending.get_attribute("class")
    assert "local committed" in pending.get_attribute("title")
    replicated = cell(page, "t0", "1")
    assert "local-only" not in replicated.get_attribute("class")
    assert "durable committed" in replicated.get_attribute("title")
    bad = cell(page, "t1", "3")
    assert bad.get_attribute("data-state") == "corrupt" and "does not match" in bad.get_attribute("title")
    lag = page.locator('table.health-table tr[data-node="t0"] td.replication')
    assert lag.get_attribute("data-pending") == "2" and "2 pending" in lag.inner_text()
    assert "local 3 · durable 1" in lag.inner_text()
    history = page.locator("table.attempts td.skipped").all_inner_texts()
    assert any("3 attempt 1 (local) — corrupt: restore: shard" in text for text in history), history
    audited = page.locator('table.attempts td.audit[data-verdict="drift"]')
    assert "optimizer: saved Adam, restoring into AdamW" in audited.inner_text(), "the restart's resume audit"
    page.screenshot(path=os.path.join(ARTIFACTS, "tiers.png"), full_page=True)
    page.close()


def test_the_job_page_shows_goodput_over_time_and_the_recommended_interval(browser, service):
    page = browser.new_page(viewport={"width": 1300, "height": 1100})
    page.goto(service.url + "/ui/jobs/advised")
    advice = httpx.get(f"{service.url}/v1/jobs/advised/advice", timeout=10).json()
    want = (8400 - 3 * 600 - 14 * 2.0) / 8400
    assert advice["goodput"] == pytest.approx(want) and advice["failures"] == 3
    shown = page.locator("#goodput")
    assert float(shown.get_attribute("data-goodput")) == pytest.approx(want, abs=1e-4)
    assert shown.inner_text().startswith("78.2 %") and "2.3 h" in shown.inner_text()
    # Young/Daly: √(2 · 2 s · 8,400 s / 3 failures) = 105.8 s; 130 steps over 7,800 s → 2 steps
    assert page.locator("#interval").inner_text().startswith("every 1.8 min ≈ 2 steps")
    assert page.locator('svg[aria-label="goodput over time"] polyline').count() == 1
    page.locator("#advice").scroll_into_view_if_needed()
    page.screenshot(path=os.path.join(ARTIFACTS, "goodput.png"), full_page=True)
    page.close()


def test_error_texts_render_as_text_never_as_markup(browser, service):
    page = browser.new_page()
    page.goto(service.url + "/ui/jobs/demo")
    error = page.locator('table.health-table tr[data-node="n2"] td.error-text')
    assert error.inner_text() == HOSTILE
    assert HOSTILE in cell(page, "n1", "4").get_attribute("title")
    assert page.evaluate("window.__pwned") is None, "no injected script ran"
    page.close()


def test_the_job_page_refreshes_in_place_without_a_reload(browser, service):
    page = browser.new_page()
    page.goto(service.url + "/ui/jobs/demo")
    page.evaluate("window.__loaded_once = true")
    assert cell(page, "n2", "5").get_attribute("data-state") == "missing"
    with ServiceClient(service.url) as client:
        attempt = client.start_attempt("demo", "n2")
        commit(service.url, None, service.settings.default_storage, "demo", "n2", Position(5), attempt)
    page.wait_for_function(
        """() => document.querySelector('td.cell[data-node="n2"][data-position="5"]').dataset.state === 'committed'""",
        timeout=15000,
    )
    assert page.evaluate("window.__loaded_once") is True, "the content was swapped in, the page was not reloaded"
    assert page.locator("#refresh-status").inner_text().startswith("live"), "the (gzip) event stream, not polling"
    assert page.locator("#last-good").inner_text() == "5", "n1's corrupt epoch 4 stays bad; epoch 5 is good now"
    page.close()


def test_the_grid_is_windowed_to_100_positions_with_paging_back(browser, service):
    page = browser.new_page()
    page.goto(service.url + "/ui/jobs/long")
    assert page.locator("th.pos").count() == 100
    assert page.locator("th.pos").first.inner_text().startswith("64")
    page.get_by_text("older →").click()
    page.wait_for_url("**/ui/jobs/long?page=1")
    assert page.locator("th.pos").count() == 30
    assert page.locator("th.pos").last.inner_text().startswith("0.b50")
    page.close()


def test_with_a_token_pages_show_nothing_until_signed_in(browser, tmp_path, caplog):
    live = start(tmp_path, token=TOKEN)
    try:
        assert httpx.get(live.url + "/v1/jobs").status_code == 401
        bare = httpx.get(live.url + "/ui/jobs/demo", headers={"X-Fragment": "1"})
        assert bare.status_code == 401 and "demo" not in bare.text and "n1" not in bare.text
        context = browser.new_context()
        page = context.new_page()
        with caplog.at_level(logging.INFO, logger="ckptstore.server"):
            page.goto(live.url + "/ui/")
            assert page.locator("input#token").is_visible()
            assert "demo" not in page.content()
            page.fill("input#token", "wrong")
            page.click("button[type=submit]")
            assert "not valid" in page.locator(".error").inner_text() and "demo" not in page.content()
            page.fill("input#token", TOKEN)
            page.click("button[type=submit]")
            page.wait_for_url("**/ui/")
            assert page.locator('tr[data-job="demo"]').is_visible()
            page.goto(live.url + "/ui/jobs/demo")
            assert cell(page, "n1", "4").get_attribute("data-state") == "corrupt"
        (cookie,) = context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
        assert TOKEN not in page.url
        assert not any(TOKEN in record.getMessage() for record in caplog.records), "the token is in no log line"
        page.screenshot(path=os.path.join(ARTIFACTS, "signed-in.png"))
        page.click("text=sign out")
        page.wait_for_url("**/ui/")
        assert page.locator("input#token").is_visible() and "demo" not in page.content()
        context.close()
    finally:
        live.stop()
