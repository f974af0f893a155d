"""The web dashboard at `/`: server-rendered pages (Jinja2, autoescaped) that refresh their content
every few seconds without a full reload (app.js swaps in the page's fragment).

With any token configured, pages need a session (server/http/auth.py): the sign-in form posts a token
once and gets an HttpOnly, SameSite=Strict cookie (Secure over https) that holds no token and
expires; a job token's session sees only its job. The router-wide dependency makes every page ask
for it; nothing here is in the OpenAPI. Every page is sent with a Content-Security-Policy that
allows only this service's own scripts and styles, and may not be framed.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import re
import time
from datetime import datetime, timezone
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from ckptstore.position import Position
from ckptstore.server.deps import DbDep, HubDep, JobName, SettingsDep
from ckptstore.server.http.auth import (
    SESSION_COOKIE,
    NotYourJob,
    Viewer,
    new_session,
    read_session,
    require_session,
    revoke_session,
    scope_of,
    session_cookie,
)
from ckptstore.server.records.rules import find_job
from ckptstore.server.routes.events import event_filter, stream_response
from ckptstore.server.ui.dashboard import GRID_WINDOW, job_detail, jobs_overview

__all__ = ["not_your_job_page", "router", "login_page"]

HERE = os.path.dirname(os.path.abspath(__file__))
REFRESH_SECONDS = 5
ASSETS = {"app.css": "text/css; charset=utf-8", "app.js": "text/javascript; charset=utf-8"}


router = APIRouter(include_in_schema=False)
ViewerDep = Annotated[Viewer, Depends(require_session)]


def _style_hash(template: str) -> str:
    """The CSP source admitting the one inline style block of `template` (the sign-in page's: it
    must render before a session exists, when the stylesheet is not served)."""
    with open(os.path.join(HERE, "templates", template), encoding="utf-8") as handle:
        match = re.search(r"<style>(.*?)</style>", handle.read(), re.S)
    assert match is not None, f"{template} has an inline style block"
    return "'sha256-" + base64.b64encode(hashlib.sha256(match.group(1).encode()).digest()).decode() + "'"


SECURITY_HEADERS = {
    "Content-Security-Policy": (
        f"default-src 'self'; style-src 'self' {_style_hash('login.html')}; img-src 'self' data:; "
        "frame-ancestors 'none'; form-action 'self'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
NO_STORE = SECURITY_HEADERS | {"Cache-Control": "no-store"}

templates = Environment(
    loader=FileSystemLoader(os.path.join(HERE, "templates")),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "—"
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _position(position: Position | None) -> str:
    if position is None:
        return "—"
    return str(position.epoch) if position.batch is None else f"{position.epoch}.b{position.batch}"


def _sparkline(
    values: list[float], width: int = 420, height: int = 60, *, bounds: tuple[float, float] | None = None
) -> str:
    """SVG polyline points for `values`, scaled into width × height — from their least to their greatest,
    or over `bounds` (low, high) — (empty when fewer than 2)."""
    if len(values) < 2:
        return ""
    low, high = bounds if bounds is not None else (min(values), max(values))
    span = (high - low) or 1.0
    step = width / (len(values) - 1)
    return " ".join(f"{i * step:.1f},{height - (v - low) / span * (height - 4) - 2:.1f}" for i, v in enumerate(values))


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _duration(seconds: float) -> str:
    """Seconds as a person reads them: 42 s, 7.5 min, 3.2 h, 2.1 d."""
    for unit, size in (("d", 86_400), ("h", 3_600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"


templates.globals.update(when=_when, position=_position, human_bytes=_human_bytes, duration=_duration)


def _page(
    request: Request, viewer: Viewer, template: str, title: str, status: int = 200, **context: Any
) -> HTMLResponse:
    """The page, or only its content when app.js asks for a refresh (`X-Fragment: 1`)."""
    content = Markup(templates.get_template(template).render(**context))
    if request.headers.get("x-fragment") == "1":
        return HTMLResponse(content, status_code=status, headers=NO_STORE)
    signed_in = request.app.state.settings.has_tokens
    job = request.path_params.get("job")
    events_url = "/ui/events" + (f"?job={job}" if job else "")
    page = templates.get_template("base.html").render(
        title=title, content=content, refresh=REFRESH_SECONDS, signed_in=signed_in, viewer=viewer, events_url=events_url
    )
    return HTMLResponse(page, status_code=status, headers=NO_STORE)


def login_page(error: str | None = None) -> HTMLResponse:
    """The token form (401): it shows no job data."""
    page = templates.get_template("login.html").render(title="ckptstore — sign in", error=error)
    return HTMLResponse(page, status_code=401, headers=NO_STORE)


def not_your_job_page() -> HTMLResponse:
    """A job token's session asked for another job (403; the same answer whether that job exists or not)."""
    page = templates.get_template("login.html").render(
        title="ckptstore — not this job", error="This sign-in is for another job. Sign out to use another token."
    )
    return HTMLResponse(page, status_code=403, headers=NO_STORE)


@router.get("/")
async def root(viewer: ViewerDep) -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/")
def jobs_page(
    request: Request,
    viewer: ViewerDep,
    db: DbDep,
    settings: SettingsDep,
    page: Annotated[int, Query(ge=0, le=10**6)] = 0,
) -> HTMLResponse:
    with db.read() as session:
        jobs, more = jobs_overview(session, page=page, stale_after=settings.health_stale_seconds, only=viewer.job)
    return _page(request, viewer, "jobs.html", "ckptstore — jobs", jobs=jobs, page=page, more=more)


@router.get("/ui/jobs/{job}")
def job_page(
    request: Request,
    viewer: ViewerDep,
    job: JobName,
    db: DbDep,
    settings: SettingsDep,
    page: Annotated[int, Query(ge=0, le=10**6)] = 0,
) -> HTMLResponse:
    if not viewer.may_see(job):
        raise NotYourJob()
    with db.read() as session:
        detail = job_detail(session, find_job(session, job), page=page, stale_after=settings.health_stale_seconds)
    return _page(
        request,
        viewer,
        "job.html",
        f"ckptstore — {job}",
        job=detail,
        window=GRID_WINDOW,
        sizes=_sparkline([float(n) for _, n in detail.sizes]),
        saves=_sparkline(detail.save_seconds),
        goodput=_sparkline([share for _, share in detail.goodput], bounds=(0.0, 1.0)),
    )


@router.get("/ui/events")
async def ui_events(request: Request, viewer: ViewerDep, hub: HubDep, job: str | None = None) -> StreamingResponse:
    """The event stream for the pages' live refresh (a job's session: its job only), from now on."""
    job, _ = event_filter(job, None, viewer.job)
    return stream_response(request, hub, None, job, None, named=False)


@router.get("/ui/static/{name}")
async def asset(viewer: ViewerDep, name: str) -> Response:
    """The stylesheet and the refresh script."""
    if name not in ASSETS:
        return Response("not found", status_code=404, media_type="text/plain", headers=SECURITY_HEADERS)
    with open(os.path.join(HERE, "static", name), "rb") as handle:
        return Response(
            handle.read(), media_type=ASSETS[name], headers=SECURITY_HEADERS | {"Cache-Control": "no-cache"}
        )


@router.post("/ui/login")
async def login(request: Request, settings: SettingsDep) -> Response:
    if not settings.has_tokens:
        return RedirectResponse("/ui/", status_code=303)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    viewer = scope_of(settings, (form.get("token") or [""])[0])
    if viewer is None:
        return login_page("That token is not valid.")
    response = RedirectResponse("/ui/", status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        new_session(settings, viewer, time.time()),
        max_age=int(settings.session_seconds),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return response


@router.post("/ui/logout")
async def logout(viewer: ViewerDep, request: Request, settings: SettingsDep, db: DbDep) -> Response:
    """Sign out: this session's cookie is refused from now on, even if someone kept a copy."""
    session = read_session(settings, session_cookie(request), time.time())
    if session is not None:
        await asyncio.to_thread(revoke_session, db, session, time.time())
    response = RedirectResponse("/ui/", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/", secure=request.url.scheme == "https", httponly=True)
    return response
