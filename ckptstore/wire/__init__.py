"""The wire schema: the JSON bodies the service and its clients exchange (pydantic v2 models) — jobs,
checkpoints, attempts and node reports (`schema`), the presigned path (`presign`), events (`events`)."""

__all__: list[str] = []
