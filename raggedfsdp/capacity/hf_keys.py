"""Typed access to the keys of a Hugging Face ``config.json``, with errors that name the key.

Real config files carry ``null`` for keys their class leaves unset (``"head_dim": null`` in some
Mistral configs, ``"q_lora_rank": null`` in DeepSeek-V2-Lite), so a ``null`` reads as absent:
the documented default applies, and a required key that is ``null`` is reported as missing.
"""

from __future__ import annotations

from typing import Any

from raggedfsdp.capacity.model_shapes import PlanError

__all__ = ["ConfigKeys"]


class ConfigKeys:
    """One parsed config and where it came from (a path or ``preset NAME``), for messages."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where = cfg, where

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, ``default`` when the key is absent or ``null``."""
        value = self.cfg.get(key)
        return default if value is None else value

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(key, default)
        if value is None:
            raise PlanError(f"{self.where}: missing {key!r}; add it (an integer >= {minimum})")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise PlanError(f"{self.where}: {key!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def optional_integer(self, key: str) -> int | None:
        """A positive integer, or ``None`` where the key is absent or ``null`` (a feature off)."""
        return None if self.get(key) is None else self.integer(key)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise PlanError(f"{self.where}: {key!r} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.get(key, [])
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise PlanError(f"{self.where}: {key!r} must be a list of layer indices, e.g. [0, 3]")
        return value

    def attention_dims(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim), checked for consistency. Without
        ``num_key_value_heads`` every head has its own keys and values (multi-head attention),
        ``transformers``' default."""
        hidden, heads = self.integer("hidden_size"), self.integer("num_attention_heads")
        kv = self.integer("num_key_value_heads", heads)
        if heads % kv:
            raise PlanError(
                f"{self.where}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv}; grouped-query attention needs it to be"
            )
        if self.get("head_dim") is None and hidden % heads:
            raise PlanError(
                f"{self.where}: hidden_size={hidden} is not a multiple of "
                f"num_attention_heads={heads}; add 'head_dim'"
            )
        return heads, kv, self.integer("head_dim", hidden // heads)
