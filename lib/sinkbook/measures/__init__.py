"""Layer 1, measures: what we compute on a model or on published numbers (sink criteria, Sink Strength,
gradient probes, theorem checks, statistics, text-capability grading). Imports only from ``core``."""
