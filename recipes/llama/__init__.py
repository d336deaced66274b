"""LLaMA-style pretraining with raggedfsdp: readable top to bottom, runnable on a laptop CPU.

Reading order: ``config`` (what can be set; ``model_config`` the model shapes), ``model`` (the
decoder; ``moe_config`` and ``moe`` its Mixture-of-Experts family), ``data`` and ``corpus``
(token files and the embedded default dataset), ``parallel`` (process groups, meshes, wrapping
with raggedfsdp or PyTorch FSDP2), ``optimizers`` (choice, parameter groups, LR schedule),
``checkpoint`` (atomic DCP checkpoints; ``checkpoint_files`` checks one before it is loaded),
``metrics`` (MFU, memory, wandb, plot) and finally ``train``, the loop that uses them all.
``prepare`` is the command that tokenizes documents (text, jsonl, parquet; ``documents``) with
a byte, Hugging Face or tiktoken tokenizer (``tokenizer``); ``launch`` is torchrun ending quietly.
"""
