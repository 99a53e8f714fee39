"""The OpenAI-compatible API server shared by every role (all-in-one, prefill, decode).

Process model: this package's API process (FastAPI + uvicorn: validation,
tokenization, chat templates, detokenization, streaming, metrics) talks to an
engine-core process (`engine_proc`) over ZMQ with msgspec messages (`wire`).
"""
