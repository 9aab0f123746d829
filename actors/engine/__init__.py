"""The sampling engine behind one interface (api): vLLM (vllm, with its LoRA adapters), the SIMULATION stand-in (simulated), and sampling a fixed prompt list to the end (offline_sampling)."""
