"""The transformer engine: the model wrapper, the decode step serving runs, sampling, and the tests' oracle."""
