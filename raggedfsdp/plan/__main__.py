"""``python -m raggedfsdp.plan``: the capacity planner (:mod:`raggedfsdp.capacity.cli`)."""

from raggedfsdp.capacity.cli import main

raise SystemExit(main())
