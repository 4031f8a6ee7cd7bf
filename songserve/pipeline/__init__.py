"""The model pipeline: prompt → backbone (q0/q1) → super-resolution (q2..q63) → decoder → files.

Four rooms: ``stages/`` (one module per stage, each with a typed seam, see ``types.py``),
``engine/`` (the transformer the stages run), ``checkpoints/`` (which files make a set, and loading
them) and ``tiny/`` (writers of the tiny checkpoint sets). ``pipeline.py`` runs the stages in order
for one request.
"""
