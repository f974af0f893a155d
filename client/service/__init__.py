"""Talking to the metadata service: `ServiceClient` (`rest`), its wire mapping, the event stream, the
presigned data path, and whole-job operations (verify, gc, reindex, copy)."""

__all__: list[str] = []
