"""Layer 0, the core: the architecture table, model loading, hooks, prompts, paths, the claim model and
profiles. Nothing here imports from another sinkbook layer."""
