"""The event stream: `GET /v1/events` as Server-Sent Events, or pages of JSON for polling clients."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from ckptstore.errors import InvalidNameError
from ckptstore.names import validate_name
from ckptstore.server.deps import HubDep
from ckptstore.server.errors import COMMON_ERRORS, ApiError, error_responses
from ckptstore.server.events.stream import EventHub
from ckptstore.server.http.protocol import ENDLESS
from ckptstore.wire.events import EVENT_TYPES, EventPage

__all__ = ["router", "stream_response", "event_filter"]

router = APIRouter(prefix="/v1", tags=["events"], responses=COMMON_ERRORS | error_responses(403))
STREAM_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no", "Vary": "Accept-Encoding"}
EVENT_ID_LIMIT = 2**63  # event ids are the database's 64-bit integers


def event_filter(job: str | None, types: str | None, scope: str | None) -> tuple[str | None, frozenset[str] | None]:
    """The job and types asked for, checked; a job token's stream is its own job's (`scope`)."""
    if job is not None:
        try:
            validate_name(job, kind="job")
        except InvalidNameError as exc:
            raise ApiError.invalid(str(exc)) from None
    if scope is not None:
        if job not in (None, scope):
            raise ApiError(403, "forbidden", "this token is for another job")
        job = scope
    wanted = None
    if types:
        wanted = frozenset(t.strip() for t in types.split(",") if t.strip())
        unknown = sorted(wanted - set(EVENT_TYPES))
        if unknown:
            raise ApiError.invalid(f"unknown event types {unknown}; known: {', '.join(EVENT_TYPES)}")
    return job, wanted


def _resume_id(after: int | None, last_event_id: str | None) -> int | None:
    if after is not None:
        return after
    if last_event_id is None:
        return None
    text = last_event_id.strip()
    if not (text.isascii() and text.isdigit() and int(text) < EVENT_ID_LIMIT):
        raise ApiError.invalid(f"Last-Event-ID must be an event id (an integer from 0 below {EVENT_ID_LIMIT})")
    return int(text)


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether an Accept-Encoding header accepts gzip (`gzip;q=0` refuses it)."""
    for item in (accept_encoding or "").lower().split(","):
        coding, *parameters = (part.strip() for part in item.split(";"))
        if coding == "gzip":
            return not any(_zero_weight(parameter) for parameter in parameters)
    return False


def _zero_weight(parameter: str) -> bool:
    name, _, value = parameter.partition("=")
    try:
        return name.strip() == "q" and float(value) == 0
    except ValueError:
        return False


RETRY = {"Retry-After": "5"}


def caller(request: Request) -> str:
    """Whose event stream this is: the job whose token the request carries, else its client's address."""
    job = getattr(request.state, "token_job", None)
    if job is not None:
        return f"job token {job}"
    return f"client {request.client.host if request.client else '?'}"


def stream_response(
    request: Request,
    hub: EventHub,
    after: int | None,
    job: str | None,
    types: frozenset[str] | None,
    *,
    named: bool = True,
) -> StreamingResponse:
    """The SSE stream from `after` (None: from now on), gzip-encoded where the client accepts it; refused
    (503, or 429 for one caller) when the process serves as many streams as it may."""
    holder = caller(request)
    settings = request.app.state.settings
    refused = hub.refusal(
        holder, most=settings.events_max_streams, most_per_holder=settings.events_max_streams_per_caller
    )
    if refused is not None:
        raise ApiError(refused[0], "unavailable" if refused[0] == 503 else "too_many", refused[1], headers=RETRY)
    start = hub.read_through if after is None else after
    gzip = accepts_gzip(request.headers.get("accept-encoding"))
    frames = hub.events(start, job=job, types=types, named=named, gzip=gzip, holder=holder)
    request.scope[ENDLESS] = True  # a shutdown closes the stream instead of waiting for its end
    headers = STREAM_HEADERS | ({"Content-Encoding": "gzip"} if gzip else {})
    return StreamingResponse(frames, media_type="text/event-stream", headers=headers)


@router.get(
    "/events",
    response_model=None,
    responses={
        200: {"content": {"text/event-stream": {}, "application/json": {"schema": EventPage.model_json_schema()}}}
    },
)
async def events(
    request: Request,
    hub: HubDep,
    job: str | None = None,
    types: Annotated[str | None, Query(description="comma-separated event types")] = None,
    after: Annotated[
        int | None, Query(ge=0, lt=EVENT_ID_LIMIT, description="events with a higher id (else Last-Event-ID)")
    ] = None,
    format: Literal["sse", "json"] = "sse",
    limit: Annotated[int, Query(ge=1, le=1000, description="events per JSON page")] = 100,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse | EventPage:
    """Every change the service records, as it happens: Server-Sent Events (`id`, `event`, `data`)
    resumed with `Last-Event-ID` or `?after=`, with heartbeats and a `reset` event when the asked id
    already left the log; `?format=json` answers one page for polling clients."""
    job, wanted = event_filter(job, types, getattr(request.state, "token_job", None))
    start = _resume_id(after, last_event_id)
    if format == "sse":
        return stream_response(request, hub, start, job, wanted)
    start = start or 0
    found, restart = await hub.page(start, job=job, types=wanted, limit=limit)
    go_on = start if restart is None else restart
    return EventPage(events=found, last_id=found[-1].id if found else go_on, reset=restart is not None)
