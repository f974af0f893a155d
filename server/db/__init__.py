"""The database: engine and transactions, tables, the hot write path's SQL, and migrations."""

__all__: list[str] = []
