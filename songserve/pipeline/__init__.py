"""The model pipeline: prompt → backbone (q0/q1) → super-resolution (q2..q63) → decoder → files.

Each stage is a small module with a typed seam (see ``types.py``); ``pipeline.py`` runs them in
order for one request and ``tiny.py`` builds the tiny checkpoint set of the real architecture.
"""
