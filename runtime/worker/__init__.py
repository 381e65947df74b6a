"""Workers: executors, the model runner, CUDA graphs, torch.compile, KV cache, attention metadata."""
