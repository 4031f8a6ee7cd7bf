"""What each program does first, whichever it is: its settings read, its logging configured.

Below every program (the dispatcher, the worker, the tiny-set writer): no module here imports one.

    settings.py  flags and the environment into one settings object; refusals in one line; the
                 non-default values logged with secrets redacted
    logs.py      logging configured once per entry point; ``safe``: text that is not ours, escaped and capped
"""
