"""Calibration's capture: the calibration tokens through the model, with hooks on each decoder layer's k_proj (its
k_norm where the model normalises keys before RoPE) and v_proj, keeping what the cache would be handed and the
gradient of the next-token loss at it.

The first `calibration.tokens` tokens (default 2048) run in chunks of `calibration.chunk` (512), each its own
sequence: pre-RoPE keys and values [1, H_kv, T, D] per layer, and the positions at which the model rotates the keys
(`kvq_lab.fit.calibration.fit_layer` rotates them as the model does). One backward pass of the next-token loss per
chunk gives each element's gradient g: KVQuant's sensitivity is the Fisher information approximation g^2 (used as
the k-means weight of nuq; the other fits use magnitudes only). Torch is imported inside `capture`.
"""

from __future__ import annotations

from typing import Any


def capture(model, ids, chunk: int) -> list[dict[str, Any]]:
    """Per decoder layer: {"key_pre", "value", "g_key_pre", "g_value"}, fp32 [1, H_kv, T, D] on the CPU, and
    "positions" [1, T]. Llama-style models (`model.model.layers[i].self_attn.k_proj / v_proj`)."""
    import torch
    from tqdm.auto import tqdm

    text_cfg = model.config.get_text_config(decoder=True)
    H = text_cfg.num_key_value_heads
    D = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(m.self_attn, "k_proj") and hasattr(m.self_attn, "v_proj") for m in layers):
        raise ValueError(
            f"calibration reads k_proj/v_proj of model.model.layers[i].self_attn (Llama-style); "
            f"{type(model).__name__} has another layout"
        )
    live: list[tuple[int, str, torch.Tensor]] = []

    def hook(i, name):
        def fn(module, args, out):
            out.retain_grad()
            live.append((i, name, out))

        return fn

    def heads_first(t: torch.Tensor, T: int) -> torch.Tensor:
        """-> [1, H, T, D]: a projection's [1, T, H * D], a per-head norm's [1, T, H, D] or [1, H, T, D]."""
        if t.dim() == 3:
            return t.view(1, T, H, D).transpose(1, 2)
        return t.transpose(1, 2) if t.shape[1] == T and t.shape[2] == H else t

    def leaf(module, args, out):  # gradients flow from the embeddings: no parameter needs one
        return out.detach().requires_grad_(True)

    handles = [model.model.embed_tokens.register_forward_hook(leaf)]
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        # keys normalised per head before RoPE (Gemma 3, Qwen 3): what RoPE rotates is k_norm's output
        keys = attn.k_norm if isinstance(getattr(attn, "k_norm", None), torch.nn.Module) else attn.k_proj
        handles.append(keys.register_forward_hook(hook(i, "key_pre")))
        handles.append(attn.v_proj.register_forward_hook(hook(i, "value")))
    grads = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    out: list[dict[str, Any]] = [{"key_pre": [], "value": [], "g_key_pre": [], "g_value": []} for _ in layers]
    try:
        with torch.enable_grad():
            starts = range(0, ids.shape[1], chunk)
            for c0 in tqdm(starts, desc="calibration", unit="chunk", leave=False):
                live.clear()
                x = ids[:, c0 : c0 + chunk].to(model.device)
                logits = model(x, use_cache=False).logits
                loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:])
                loss.backward()
                for i, name, t in live:
                    T = x.shape[1]
                    out[i][name].append(heads_first(t.detach().float(), T).cpu())
                    out[i]["g_" + name].append(heads_first(t.grad.float(), T).cpu())
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.requires_grad_(grads[id(p)])
    # each chunk is its own sequence (positions restart): its keys were rotated at 0..chunk-1
    pos = torch.cat([torch.arange(min(chunk, ids.shape[1] - c0)) for c0 in range(0, ids.shape[1], chunk)])
    return [{k: torch.cat(v, 2) for k, v in d.items()} | {"positions": pos[None]} for d in out]
