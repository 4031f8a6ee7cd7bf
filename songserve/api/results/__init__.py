"""Finished takes on the dispatcher's disk: copied, checked, kept, rendered and, in time, removed.

artifacts.py     each finished track's WAV, MP3, codes and JSON, copied from its worker
result_check.py  is a copied file what the worker said it wrote?
folder.py        whether the results folder can be written now (a local fault stays local)
retention.py     finished jobs and uploads leave after their TTL, oldest first over the cap
render.py        a finished take in another format, loudness or range; cached on disk
render_audio.py  a render's audio work, block by block
"""
