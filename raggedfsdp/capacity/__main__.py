"""``python -m raggedfsdp.capacity`` (or ``python -m raggedfsdp.plan``): see
:mod:`raggedfsdp.capacity.cli`."""

from raggedfsdp.capacity.cli import main

raise SystemExit(main(prog="python -m raggedfsdp.capacity"))
