"""How new weights reach a generator: sources and the poller (updates), the relay and broadcast transports, host copies, CUDA receive paths, the in-place load into vLLM."""
