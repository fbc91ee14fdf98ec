"""draftsmith: train, re-tune, evaluate and serve drafters for exact speculative decoding."""
__version__ = "0.1.0"
