"""Storage over fsspec: the face the core uses (`filesystem`), durable local writes (`localfs`, `direct_io`),
what a backend's exception means (`failures`), what exists (`listing`), the cp_accessible probe (`probe`) and
the base of the filesystems whose reads are range requests (`ranged`)."""

__all__: list[str] = []
