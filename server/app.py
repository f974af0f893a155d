"""`create_app(settings)`: the FastAPI application, its resources and its error mapping.

The database engine is created in the lifespan (never at import time) and schema migrations are
not run here: `ckptstore.server.db.migrate` runs them once before workers start.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptstore import tracing
from ckptstore.server.db.engine import Database, make_engine
from ckptstore.server.errors import STATUS_CODES, ApiError, error_body
from ckptstore.server.events.stream import EventHub
from ckptstore.server.events.webhooks import WebhookDispatcher
from ckptstore.server.http.auth import LoginRequired, NotYourJob, TokenAuth
from ckptstore.server.http.fastpath import CachedReads, WriteFastPath
from ckptstore.server.http.middleware import BodyLimit, RequestMetrics
from ckptstore.server.http.origin import RequestGuard
from ckptstore.server.metrics import METRICS
from ckptstore.server.presign.signer import Signer
from ckptstore.server.records import restarts, rules
from ckptstore.server.records.agreement import AgreementWaiters
from ckptstore.server.records.answers import AnswerCache
from ckptstore.server.records.batching import WriteBatcher
from ckptstore.server.records.versions import VersionWatch
from ckptstore.server.routes import ROUTERS
from ckptstore.server.settings import Settings
from ckptstore.server.ui.pages import login_page, not_your_job_page
from ckptstore.server.ui.pages import router as ui_router
from ckptstore.wire.schema import LastGood, ResumeAgreement

__all__ = ["create_app", "app_factory"]

log = logging.getLogger("ckptstore.server")
WHOLE_ANSWERS = (
    64  # whole last-good answers kept as models, to cut one node's part from (ckptstore.server.records.answers)
)


def _error(status: int, code: str, detail: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(code, detail), status_code=status, headers=headers, media_type="application/json")


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where}: {error.get('msg', 'invalid')}" if where else str(error.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return _error(exc.status, exc.code, exc.detail, exc.headers)

    @app.exception_handler(LoginRequired)
    async def login_required(_: Request, exc: LoginRequired) -> HTMLResponse:
        return login_page()

    @app.exception_handler(NotYourJob)
    async def not_your_job(_: Request, exc: NotYourJob) -> HTMLResponse:
        return not_your_job_page()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return _error(422, "invalid", _validation_detail(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        code = STATUS_CODES.get(exc.status_code, "invalid")
        return _error(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(IntegrityError)
    async def integrity(_: Request, exc: IntegrityError) -> Response:
        log.warning("integrity error answered 409: %s", type(exc.orig).__name__)
        return _error(409, "conflict", "a concurrent request changed the same record; retry")

    @app.exception_handler(OperationalError)
    async def database_unavailable(_: Request, exc: OperationalError) -> Response:
        METRICS.db_errors.inc()
        log.error("database error answered 503: %s", type(exc.orig).__name__)
        return _error(503, "unavailable", "the database is unavailable; retry", {"Retry-After": "1"})

    @app.exception_handler(PoolTimeoutError)
    async def database_busy(_: Request, exc: PoolTimeoutError) -> Response:
        """Every database connection of this process stayed busy past the pool's timeout (a restart
        storm on too few replicas): overloaded, not broken — the client retries."""
        METRICS.db_errors.inc()
        log.warning("no database connection free: answered 503")
        return _error(503, "unavailable", "the service is overloaded; retry", {"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return _error(500, "unavailable", "internal error")


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service for `settings` (default: from the environment)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = app.state.db = Database(make_engine(settings.database_url))
        app.state.answers = AnswerCache[bytes](settings.answer_cache_size)
        app.state.job_answers = AnswerCache[bytes](settings.answer_cache_size)
        app.state.whole_answers = AnswerCache[LastGood](WHOLE_ANSWERS)

        def agreement_of(job: str) -> ResumeAgreement:
            with db.read() as session:
                return restarts.resume_agreement(session, rules.find_job(session, job))

        app.state.agreements = AgreementWaiters(agreement_of)
        hub = app.state.hub = EventHub(
            db,
            poll_seconds=settings.events_poll_seconds,
            heartbeat_seconds=settings.events_heartbeat_seconds,
            window_seconds=settings.events_window_seconds,
        )
        await hub.start()
        dispatcher = app.state.webhooks = WebhookDispatcher(db, settings)

        def new_events(newest: int) -> None:
            hub.wake(newest)
            dispatcher.wake(newest)

        db.on_events = new_events
        app.state.versions = VersionWatch(db, on_events=new_events)
        app.state.writes = WriteBatcher(db)
        app.state.signer = Signer(settings.storage_options)
        try:
            yield
        finally:
            app.state.writes.close()
            app.state.versions.stop()
            dispatcher.stop()
            await hub.stop()
            db.dispose()

    app = FastAPI(
        title="ckptstore",
        version="0.1.0",
        lifespan=lifespan,
        description="Per-job, per-node checkpoint records, last good epoch, storage health and stats.",
    )
    app.state.settings = settings
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(ui_router)
    _install_error_handlers(app)
    token = settings.token.get_secret_value() if settings.token else None
    app.add_middleware(WriteFastPath)  # innermost, with the next: every middleware below still wraps them
    app.add_middleware(CachedReads)
    job_tokens = {job: secret.get_secret_value() for job, secret in settings.job_tokens.items()}
    app.add_middleware(TokenAuth, token=token, job_tokens=job_tokens)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestGuard, allowed_hosts=settings.accepted_hosts)
    app.add_middleware(RequestMetrics)
    if tracing.enabled():  # outermost: a span for every request, in the trace its traceparent names
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        app.add_middleware(OpenTelemetryMiddleware)
    return app


YOUNG_COLLECTION_THRESHOLD = 10_000  # CPython's default is 700; bench/RESULTS.md, events
GIL_SWITCH_SECONDS = 0.001  # CPython's default is 0.005; bench/RESULTS.md, events


def app_factory() -> FastAPI:
    """For `uvicorn --factory ckptstore.server.app:app_factory` (`ckptstore serve`): settings from the environment.

    The modules and the app live as long as the process: frozen out of the garbage collector's
    reach, a full collection no longer scans them (~90 ms every ~0.6 s under 1,000 commits/s:
    bench/RESULTS.md). The youngest generation is collected every YOUNG_COLLECTION_THRESHOLD
    allocations, not 700: the objects of requests in flight then die young instead of being promoted
    into the older generations, whose collections also scan every open event stream's objects.
    A thread waiting for the GIL asks for it after GIL_SWITCH_SECONDS, not 5 ms: the group-commit
    writer takes it back after every database call, and the event loop holds it for whole bursts
    (a wake-up's sends to every event stream). Only here, in the service's own process, never in a
    caller's (tests)."""
    app = create_app()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    return app
