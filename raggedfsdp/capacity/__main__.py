"""``python -m raggedfsdp.capacity``: the ``raggedfsdp`` program (:mod:`raggedfsdp.capacity.cli`)
under the name it was started by."""

from raggedfsdp.capacity.cli import MODULE_PROG, console_main

raise SystemExit(console_main(prog=MODULE_PROG))
