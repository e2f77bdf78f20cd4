"""Layer 2, interventions: changes to a model's computation, each tested against its definition (OutRo,
V-scale, Zero-K). Imports from ``core`` and ``measures``."""
