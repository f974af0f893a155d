"""The on-storage format: names and layout, the manifest, safetensors shards, the blob codec, CRC32C and
verified reads."""

__all__: list[str] = []
