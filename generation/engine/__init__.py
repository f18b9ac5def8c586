"""The generation loop: request state, detokenisation and the batched model runner."""
