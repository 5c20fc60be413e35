"""The reference both Megatron tests compare tree-packed logprobs against: every root-to-target chain of a
packed batch run alone through Megatron's stock forward (sequence index = tree depth on a chain), reading
the logit at the target's parent."""

from __future__ import annotations

import torch
from gyre_traj.pack import PackedBatch


def path_logprobs(gpt: torch.nn.Module, batch: PackedBatch, device: str = "cpu") -> torch.Tensor:
    out = []
    par = batch.parent
    for tp, tid in zip(batch.target_pos.tolist(), batch.target_ids.tolist(), strict=True):
        chain = [tp]
        while par[chain[-1]] >= 0:
            chain.append(int(par[chain[-1]]))
        ids = torch.as_tensor(batch.input_ids[chain[::-1]], dtype=torch.long, device=device)[None]
        n = ids.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)[None, None]  # True = masked
        logits = gpt(input_ids=ids, position_ids=torch.arange(n, device=device)[None], attention_mask=mask)
        out.append(torch.log_softmax(logits[0, -1].float(), -1)[tid])
    return torch.stack(out)
