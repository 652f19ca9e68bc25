#!/usr/bin/python3
"""An independent Llama forward pass in NumPy (float64), for fastlane-llm's tests.

Usage: llama_forward.py MODEL_DIR IDS_JSON POSITIONS_JSON
Reads config.json and the *.safetensors files of MODEL_DIR (single or sharded; f32, bf16 or
f16) with nothing but the format's definition (8-byte little-endian header length, a JSON
header, raw little-endian data), runs the token ids of IDS_JSON through the model, and
prints as JSON the logits at each position of POSITIONS_JSON.
"""
import json
import os
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = data[base + a : base + b]
        dt = info["dtype"]
        if dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif dt == "F16":
            arr = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif dt == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{path}: tensor {name}: dtype {dt} not handled by the reference")
        out[name] = arr.reshape(info["shape"]).astype(np.float64)
    return out


def main():
    model_dir, ids_path, pos_path = sys.argv[1:4]
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    w = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            w.update(read_safetensors(os.path.join(model_dir, f)))
    ids = json.load(open(ids_path))
    positions = json.load(open(pos_path))
    h = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    eps = cfg.get("rms_norm_eps", 1e-5)
    theta = cfg.get("rope_theta", 10000.0)
    t = len(ids)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(v):
        a, b = v[..., : hd // 2], v[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    mask = np.triu(np.full((t, t), -np.inf), 1)
    x = w["model.embed_tokens.weight"][ids]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        y = norm(x, w[p + "input_layernorm.weight"])
        q = rope((y @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, hd))
        k = rope((y @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd))
        v = (y @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
        k = np.repeat(k, nh // nkv, axis=1)
        v = np.repeat(v, nh // nkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(t, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        y = norm(x, w[p + "post_attention_layernorm.weight"])
        g = y @ w[p + "mlp.gate_proj.weight"].T
        u = y @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = norm(x[positions], w["model.norm.weight"]) @ head.T
    json.dump(logits.tolist(), sys.stdout)


if __name__ == "__main__":
    main()
