"""`kvlab serve`: an OpenAI-compatible server over a continuous batch with lossless decoding per request.

The HTTP layer (`app`, `protocol`, `page`) stays apart from the engine (`engine`), which runs the
continuous batch on its own thread; `options` turns a request body into engine settings.
"""
