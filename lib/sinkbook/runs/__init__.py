"""Layer 4, runs: cached jobs that drive models and return plain records for the chapters.

Chapters never load a model, train or run a forward pass themselves: they ask this layer for records (dicts,
tables, arrays). A job is named by ``core.paths.cache_key`` of its configuration under ``core.paths.cache_root``,
so a second build reads what the first computed; ``pool.run_jobs`` runs jobs in worker processes.
"""
