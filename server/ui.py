"""The web dashboard at `/`: server-rendered pages (Jinja2, autoescaped) that refresh their content
every few seconds without a full reload (app.js swaps in the page's fragment).

With a token configured, pages need a session: the login form posts the token once and gets an
HttpOnly, SameSite=Strict cookie holding an HMAC of it (never the token, never in a URL). The
router-wide dependency makes every page and asset ask for it; nothing here is in the OpenAPI.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from datetime import datetime, timezone
from http.cookies import SimpleCookie
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from ckptstore.position import Position
from server.dashboard import GRID_WINDOW, job_detail, jobs_overview, resumed_from
from server.deps import DbDep, JobName, SettingsDep
from server.records import find_job
from server.settings import Settings

__all__ = ["router", "LoginRequired", "login_page", "SESSION_COOKIE", "session_value"]

HERE = os.path.dirname(os.path.abspath(__file__))
SESSION_COOKIE = "ckptstore_session"
REFRESH_SECONDS = 5
ASSETS = {"app.css": "text/css; charset=utf-8", "app.js": "text/javascript; charset=utf-8"}


class LoginRequired(Exception):
    """A page was asked for without a valid session while a token is configured."""


def session_value(token: str) -> str:
    """The cookie value for `token`: an HMAC, so the cookie never holds the token itself."""
    return hmac.new(token.encode(), b"ckptstore dashboard session", hashlib.sha256).hexdigest()


def _token(settings: Settings) -> str | None:
    return settings.token.get_secret_value() if settings.token else None


async def _require_session(request: Request, settings: SettingsDep) -> None:
    token = _token(settings)
    if token is None or request.url.path == "/ui/login":
        return
    cookie = SimpleCookie(request.headers.get("cookie", ""))
    supplied = cookie[SESSION_COOKIE].value if SESSION_COOKIE in cookie else ""
    if not hmac.compare_digest(supplied.encode(), session_value(token).encode()):
        raise LoginRequired()


router = APIRouter(include_in_schema=False, dependencies=[Depends(_require_session)])

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


def _sparkline(values: list[float], width: int = 420, height: int = 60) -> str:
    """SVG polyline points for `values`, scaled into width × height (empty when fewer than 2)."""
    if len(values) < 2:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    step = width / (len(values) - 1)
    return " ".join(f"{i * step:.1f},{height - (v - low) / span * (height - 4) - 2:.1f}" for i, v in enumerate(values))


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


templates.globals.update(when=_when, position=_position, human_bytes=_human_bytes)


def _page(request: Request, template: str, title: str, status: int = 200, **context) -> HTMLResponse:
    """The page, or only its content when app.js asks for a refresh (`X-Fragment: 1`)."""
    content = Markup(templates.get_template(template).render(**context))
    if request.headers.get("x-fragment") == "1":
        return HTMLResponse(content, status_code=status)
    signed_in = _token(request.app.state.settings) is not None
    page = templates.get_template("base.html").render(
        title=title, content=content, refresh=REFRESH_SECONDS, signed_in=signed_in
    )
    return HTMLResponse(page, status_code=status, headers={"Cache-Control": "no-store"})


def login_page(error: str | None = None) -> HTMLResponse:
    """The token form (401): it shows no job data."""
    page = templates.get_template("login.html").render(title="ckptstore — sign in", error=error)
    return HTMLResponse(page, status_code=401, headers={"Cache-Control": "no-store"})


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/")
def jobs_page(request: Request, db: DbDep, settings: SettingsDep, page: Annotated[int, Query(ge=0, le=10**6)] = 0):
    with db.read() as session:
        jobs, more = jobs_overview(session, page=page, stale_after=settings.health_stale_seconds)
    return _page(request, "jobs.html", "ckptstore — jobs", jobs=jobs, page=page, more=more)


@router.get("/ui/jobs/{job}")
def job_page(
    request: Request,
    job: JobName,
    db: DbDep,
    settings: SettingsDep,
    page: Annotated[int, Query(ge=0, le=10**6)] = 0,
):
    with db.read() as session:
        detail = job_detail(session, find_job(session, job), page=page, stale_after=settings.health_stale_seconds)
    return _page(
        request,
        "job.html",
        f"ckptstore — {job}",
        job=detail,
        window=GRID_WINDOW,
        resumed_from=resumed_from,
        sizes=_sparkline([float(n) for _, n in detail.sizes]),
        saves=_sparkline(detail.save_seconds),
    )


@router.get("/ui/static/{name}")
async def asset(name: str) -> Response:
    if name not in ASSETS:
        return Response("not found", status_code=404, media_type="text/plain")
    with open(os.path.join(HERE, "static", name), "rb") as handle:
        return Response(handle.read(), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.post("/ui/login")
async def login(request: Request, settings: SettingsDep) -> Response:
    token = _token(settings)
    if token is None:
        return RedirectResponse("/ui/", status_code=303)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    supplied = (form.get("token") or [""])[0]
    if not hmac.compare_digest(supplied.encode(), token.encode()):
        return login_page("That token is not valid.")
    response = RedirectResponse("/ui/", status_code=303)
    response.set_cookie(SESSION_COOKIE, session_value(token), httponly=True, samesite="strict", path="/")
    return response


@router.post("/ui/logout")
async def logout() -> Response:
    response = RedirectResponse("/ui/", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
