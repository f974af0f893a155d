"""FastAPI dependencies: the database, the settings and validated path names, as Annotated aliases.

They are `async def` because they do no I/O: a plain `def` dependency costs a thread-pool hop per
request, which dominated the hot last-good path.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from ckptstore.errors import InvalidNameError
from ckptstore.names import NAME_JSON_SCHEMA, validate_name
from server.db import Database
from server.errors import ApiError
from server.settings import Settings

__all__ = ["DbDep", "SettingsDep", "JobName", "NodeName"]


async def _db(request: Request) -> Database:
    return request.app.state.db


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _validated_name(value: str, kind: str) -> str:
    try:
        return validate_name(value, kind=kind)
    except InvalidNameError as exc:
        raise ApiError.invalid(str(exc)) from None


async def _job_name(job: Annotated[str, Path(description="job name", json_schema_extra=NAME_JSON_SCHEMA)]) -> str:
    return _validated_name(job, "job")


async def _node_name(node: Annotated[str, Path(description="node name", json_schema_extra=NAME_JSON_SCHEMA)]) -> str:
    return _validated_name(node, "node")


DbDep = Annotated[Database, Depends(_db)]
SettingsDep = Annotated[Settings, Depends(_settings)]
JobName = Annotated[str, Depends(_job_name)]
NodeName = Annotated[str, Depends(_node_name)]
