"""Layer 3, training: one training loop (``loop.fit``) and what it trains on (corpora, from-scratch models).
Imports from the layers below."""
