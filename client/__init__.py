"""What runs in training scripts: the command line today; ServiceClient, Keras callback and loop manager next."""

__all__: list[str] = []
