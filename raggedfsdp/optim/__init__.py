"""Sharded optimizers (``AdamW``, ``AdamW8bit``, ``Muon``, ``Shampoo``): not implemented yet."""
