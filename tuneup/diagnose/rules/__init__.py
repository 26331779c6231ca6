"""The rule catalog, one module per area; importing this package registers every rule."""

from . import code, compiled, distributed, gpu, input, precision, syncs  # noqa: F401
