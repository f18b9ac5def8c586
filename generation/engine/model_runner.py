"""PaddedBatch: runs the model over left-padded prompts with a contiguous per-sequence KV cache."""

from __future__ import annotations

import torch

from generation.layers.attention import AttentionMetadata
from generation.models.llama import KVCache, LlamaForCausalLM


class PaddedBatch:
    """One batch of sequences decoding in lockstep.

    Prompts are left-padded to a common length P so that every row writes its step-t token to
    cache slot P + t; a key mask hides the padding, and positions count from each row's first
    real token, so a padded row computes what it would compute alone.
    """

    def __init__(self, model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> None:
        assert prompts and all(prompts)
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        self.prompt_len = max(len(p) for p in prompts)
        self.capacity = self.prompt_len + max_new_tokens
        batch = len(prompts)
        self.num_pads = torch.tensor([self.prompt_len - len(p) for p in prompts], device=self.device)
        shape = (batch, cfg.num_key_value_heads, self.capacity, cfg.head_dim)
        self.kv_caches: KVCache = [
            (
                torch.empty(shape, device=self.device, dtype=self.dtype),
                torch.empty(shape, device=self.device, dtype=self.dtype),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        # Token id 0 for padding: any valid id works, the mask keeps it out of every real row.
        self.input_ids = torch.tensor([[0] * (self.prompt_len - len(p)) + p for p in prompts], device=self.device)
        self.length = 0  # cache slots filled

    def prefill(self) -> torch.Tensor:
        """Run the prompts; return next-token logits [B, V] (fp32)."""
        return self._step(self.input_ids)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B]); return next-token logits [B, V] (fp32)."""
        assert self.length < self.capacity
        return self._step(tokens[:, None])

    def keep(self, rows: list[int]) -> None:
        """Drop finished rows so later steps compute only the live ones."""
        index = torch.tensor(rows, device=self.device)
        self.num_pads = self.num_pads[index]
        self.kv_caches = [(k[index], v[index]) for k, v in self.kv_caches]

    def _step(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, seq_len = self.length, input_ids.shape[1]
        slots = torch.arange(start, start + seq_len, device=self.device)  # [S] new slots
        keys = torch.arange(start + seq_len, device=self.device)  # [T] all slots so far
        pads = self.num_pads[:, None]  # [B, 1]
        positions = (slots[None, :] - pads).clamp(min=0)  # [B, S]
        # [B, 1, S, T]: causal and not padding; a padding query sees itself only, so that no
        # softmax row is empty (which would give NaN). Real rows never read padding outputs.
        visible = (keys[None, None, :] <= slots[None, :, None]) & (keys[None, None, :] >= pads[:, :, None])
        visible |= keys[None, None, :] == slots[None, :, None]
        meta = AttentionMetadata(start=start, mask=visible[:, None])
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        self.length += seq_len
        return self.model.compute_logits(hidden[:, -1]).float()
