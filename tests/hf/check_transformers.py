#!/usr/bin/env python3
"""moecore vs Hugging Face transformers' OLMoE, both directions, in FP32 on CPU.

1. import: a small random OlmoeForCausalLM saved by transformers is imported with
   `moecore import-hf`; moecore's logits and loss must match transformers'.
2. export: a model trained a few steps by moecore is exported with `moecore export-hf`,
   loaded by OlmoeForCausalLM.from_pretrained, and its logits must match moecore's.
Errors are normalised by the largest |logit|. Prints one JSON object (and writes it to
--out when given). Exit status 1 when a check fails.

usage: check_transformers.py MOECORE_BINARY [--out FILE.json]
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import OlmoeConfig, OlmoeForCausalLM

TOL_FP32 = 1e-4   # normalised max logit error (FP32 vs FP32, different GEMM orders)
TOL_LOSS = 1e-4   # absolute loss difference, nats


def run(cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"command failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def moecore_logits(binary, ckpt, tokens, work):
    out = Path(work) / "logits.f32"
    text = run([binary, "logits", ckpt, "--tokens", ",".join(map(str, tokens)), "--out", out])
    loss = float(text.split("loss")[1].split()[0])
    return np.fromfile(out, dtype=np.float32).reshape(len(tokens), -1), loss


def hf_logits(model, tokens):
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return out.logits[0].float().numpy(), float(out.loss)


def compare(a, b):
    return float(np.max(np.abs(a - b)) / max(1e-12, float(np.max(np.abs(b)))))


def main():
    binary = Path(sys.argv[1]).resolve()
    out_path = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    result = {"transformers": __import__("transformers").__version__, "torch": torch.__version__}
    ok = True
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        # 1. transformers -> moecore
        cfg = OlmoeConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=False, rms_norm_eps=1e-5, max_position_embeddings=256,
                          initializer_range=0.1, tie_word_embeddings=False,
                          eos_token_id=0, pad_token_id=1, bos_token_id=None)
        model = OlmoeForCausalLM(cfg).float().eval()
        model.save_pretrained(work / "hf_in")
        run([binary, "import-hf", work / "hf_in", work / "ck_in"])
        tokens = rng.integers(0, 256, size=48).tolist()
        ml, mloss = moecore_logits(binary, work / "ck_in", tokens, work)
        hl, hloss = hf_logits(model, tokens)
        result["import_logit_err"] = compare(ml, hl)
        result["import_loss_diff"] = abs(mloss - hloss)
        ok &= result["import_logit_err"] <= TOL_FP32 and result["import_loss_diff"] <= TOL_LOSS

        # 2. moecore -> transformers
        run([binary, "train", "--run.dir=" + str(work / "run"), "--train.steps=5", "--train.eval_interval=0",
             "--model.dense_layers=[]", "--moe.shared_experts=0", "--moe.norm_topk_prob=true",
             "--model.d_model=64", "--model.n_layers=2", "--moe.expert_hidden=32", "--train.seq_len=32",
             "--train.micro_batch=4", "--train.global_batch=4", "--log.interval=5"])
        run([binary, "export-hf", work / "run" / "checkpoints", work / "hf_out", "--dtype", "fp32"])
        loaded = OlmoeForCausalLM.from_pretrained(work / "hf_out", torch_dtype=torch.float32).eval()
        ml, mloss = moecore_logits(binary, work / "run" / "checkpoints", tokens, work)
        hl, hloss = hf_logits(loaded, tokens)
        result["export_logit_err"] = compare(ml, hl)
        result["export_loss_diff"] = abs(mloss - hloss)
        ok &= result["export_logit_err"] <= TOL_FP32 and result["export_loss_diff"] <= TOL_LOSS

        run([binary, "export-hf", work / "run" / "checkpoints", work / "hf_bf16", "--dtype", "bf16"])
        loaded = OlmoeForCausalLM.from_pretrained(work / "hf_bf16", torch_dtype=torch.float32).eval()
        hl, _ = hf_logits(loaded, tokens)
        result["export_bf16_weights_logit_err"] = compare(ml, hl)  # rounding of weights only, reported
    result["tolerance"] = TOL_FP32
    result["passed"] = bool(ok)
    text = json.dumps(result, indent=2)
    print(text)
    if out_path:
        Path(out_path).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
