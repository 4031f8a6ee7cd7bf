"""Audio files both services read the same way: a person's upload, and a take's code grid.

reading.py  a person's audio file as the codec takes it (44.1 kHz stereo): checked by the
            dispatcher before it stores an upload, read by the worker to encode it
codes.py    a take's code grid as a file (``.codes``), kept beside every WAV so it can be continued
"""
