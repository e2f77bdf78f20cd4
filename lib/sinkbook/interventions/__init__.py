"""Layer 2, interventions: changes to a model's computation or weights, each tested against its definition: OutRo,
V-scale, Zero-K, QK-norm fixed or injected, head-selective sink protection, LoRA, weight merging, post-training
quantisation. Imports from ``core`` and ``measures``."""
