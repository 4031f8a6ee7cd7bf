"""The stages of a song: prompt, tokenizer, backbone, super-resolution, codec (RVQ + DAC decoder), export.

Beside them: the length plan (``length.py``), a repaint's join (``join.py``), the decoded audio of the
latest takes an edit decodes against (``kept_audio.py``) and the MP3 file export writes (``mp3.py``: LAME's
frames, the ID3 tag and the Info frame)."""
