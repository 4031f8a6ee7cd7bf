"""The stages of a song: prompt, tokenizer, backbone, super-resolution, codec (RVQ + DAC decoder), export."""
