"""Storage over fsspec: the face the core uses (`filesystem`), durable local writes (`localfs`, `direct_io`),
what a backend's exception means (`failures`), what exists (`listing`) and the cp_accessible probe (`probe`)."""

__all__: list[str] = []
