"""Building blocks of the decoder: norm, rotary embedding, attention, sampler."""
