"""The top-level names: served lazily, yet listed by ``dir()`` and ``__all__`` like eager ones."""

from __future__ import annotations

import subprocess
import sys

import raggedfsdp
import raggedfsdp.fsdp


def test_dir_lists_every_lazy_name_and_no_helpers():
    names = dir(raggedfsdp)
    assert set(raggedfsdp.__all__) <= set(names)
    assert "__version__" in names
    assert not [n for n in names if n.startswith("_") and not n.startswith("__")], names
    assert "import_module" not in names and "Any" not in names


def test_every_name_in_all_resolves_to_the_fsdp_object():
    for name in raggedfsdp.__all__:
        assert getattr(raggedfsdp, name) is getattr(raggedfsdp.fsdp, name), name
    namespace: dict[str, object] = {}
    exec("from raggedfsdp import *", namespace)  # the star import users write
    assert set(raggedfsdp.__all__) <= set(namespace)


def test_dir_does_not_import_torch():
    """Listing the names must not load them: the capacity planner's CLI starts without torch."""
    probe = "import sys, raggedfsdp; dir(raggedfsdp); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
