"""``python -m raggedfsdp.plan``: see :mod:`raggedfsdp.plan.cli`."""

from raggedfsdp.plan.cli import main

raise SystemExit(main())
