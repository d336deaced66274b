"""The capacity planner's former home: ``raggedfsdp.capacity`` under its old name, so that
``from raggedfsdp.plan import ...`` and ``python -m raggedfsdp.plan`` keep working."""

from raggedfsdp.capacity import *  # noqa: F403 (the same public names, one list of them)
from raggedfsdp.capacity import __all__  # noqa: F401
