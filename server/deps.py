"""FastAPI dependencies: the database, the settings and validated path names, as Annotated aliases.

They are `async def` because they do no I/O: a plain `def` dependency costs a thread-pool hop per
request, which dominated the hot last-good path.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request

from ckptstore.errors import InvalidNameError
from ckptstore.names import NAME_JSON_SCHEMA, validate_name
from ckptstore.server.db.engine import Database
from ckptstore.server.errors import ApiError
from ckptstore.server.events.stream import EventHub
from ckptstore.server.http.paging import PAGE_LIMIT, Page
from ckptstore.server.records.agreement import AgreementWaiters
from ckptstore.server.records.batching import WriteBatcher
from ckptstore.server.settings import Settings

__all__ = [
    "AgreementsDep",
    "DbDep",
    "WritesDep",
    "SettingsDep",
    "JobName",
    "NodeName",
    "PageDep",
    "HubDep",
    "checked_name",
]


async def _db(request: Request) -> Database:
    return request.app.state.db


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


def checked_name(value: str, kind: str) -> str:
    """`value` if it is a valid name of a `kind`; else a 422 naming the rule."""
    try:
        return validate_name(value, kind=kind)
    except InvalidNameError as exc:
        raise ApiError.invalid(str(exc)) from None


async def _job_name(job: Annotated[str, Path(description="job name", json_schema_extra=NAME_JSON_SCHEMA)]) -> str:
    return checked_name(job, "job")


async def _node_name(node: Annotated[str, Path(description="node name", json_schema_extra=NAME_JSON_SCHEMA)]) -> str:
    return checked_name(node, "node")


async def _writes(request: Request) -> WriteBatcher:
    return request.app.state.writes


async def _agreements(request: Request) -> AgreementWaiters:
    return request.app.state.agreements


async def _hub(request: Request) -> EventHub:
    return request.app.state.hub


async def _page(
    limit: Annotated[int, Query(ge=1, le=PAGE_LIMIT, description="rows per page")] = 1000,
    offset: Annotated[int, Query(ge=0, le=10**9, description="rows to skip")] = 0,
) -> Page:
    return Page(limit, offset)


DbDep = Annotated[Database, Depends(_db)]
WritesDep = Annotated[WriteBatcher, Depends(_writes)]
SettingsDep = Annotated[Settings, Depends(_settings)]
JobName = Annotated[str, Depends(_job_name)]
NodeName = Annotated[str, Depends(_node_name)]
PageDep = Annotated[Page, Depends(_page)]
HubDep = Annotated[EventHub, Depends(_hub)]
AgreementsDep = Annotated[AgreementWaiters, Depends(_agreements)]
