"""A take's live audio: the PCM a listener hears while the take is still being made.

take.py       ``LiveAudio``: one take's live state and its PCM file, shared by three threads
previewer.py  ``Previewer``: the thread that makes it during the backbone (superres over a window,
              the decoder, PCM)
"""
