"""What the dispatcher's scheduling and fault tests run instead of the model (``--pipeline test``).

tone.py  ``TonePipeline``: a deterministic tone after a configurable delay, with the real export
"""
