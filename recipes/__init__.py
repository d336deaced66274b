"""Training recipes built on raggedfsdp (see recipes/README.md). ``recipes.llama`` is the
LLaMA-style pretraining recipe, the project's main job."""
