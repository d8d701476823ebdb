"""kvlab: KV-cache compression, lossless speculative decoding on compressed caches, KV codecs.

Quick start::

    from kvlab.models import load_model
    from kvlab.generation import GenerationConfig
    from kvlab.engine import generate

    loaded = load_model()  # the embedded SmolLM2-135M-Instruct, offline
    prompt = loaded.encode_prompt("What is a KV cache?")
    output = generate(loaded, [prompt], GenerationConfig(max_new_tokens=64))
    print(output.requests[0].text)
"""

__version__ = "0.1.0"
