"""LoRA adapters per request: their files, and which ones a worker holds.

    format.py            PEFT's layout with Megatron's module names, read and checked at load
    safetensors_file.py  the safetensors format, read and written with torch alone
    residency.py         at most ``MAX_ADAPTERS`` held, least recently used evicted, each in a slot

The math (each row's low-rank delta, gathered from fixed slots) is the engine's: ``engine/lora.py``.
"""
