"""Engine: KV slot pool and requests (kv_pool), routing stock Hugging Face models through our
attention (hf), and the prefill / decode loop with one compiled graph per batch bucket and
step kind (engine)."""
