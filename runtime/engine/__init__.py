"""The engine: requests in, tokens out (LLMEngine, scheduler, block manager, sequences, sampler, detokenizer)."""
