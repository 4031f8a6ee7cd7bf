"""The stages of a song: prompt, tokenizer, backbone, super-resolution, codec (RVQ + DAC decoder), export.

Beside them: the length plan (``length.py``) and a repaint's join (``join.py``)."""
