"""The engine core: the busy loop, the scheduler, requests and their KV blocks."""
