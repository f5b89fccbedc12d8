#!/usr/bin/env python3
"""Tokenizer throughput, moecore vs the Python `tokenizers` library (pinned in scripts/setup.sh,
in .deps/py). Trains a GPT-2 style and a Llama 3 style byte-level BPE tokenizer (8192 tokens)
on this checkout's sources and docs, builds a text of --mb MB from those files and a generated
multilingual part, then times on that same text: moecore_tokenizer_bench (one thread), the
library's encode() on the whole text (one call), and encode_batch() over 64 KB chunks (its
thread pool; RAYON_NUM_THREADS sets the threads). Checks that moecore's ids equal encode()'s.
Usage: bench/tokenizer_bench.py --bench build/cpu/moecore_tokenizer_bench [--mb 4] [--repeats 3]
"""
import argparse
import glob
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def source_text():
    parts = []
    for pattern in ("src/**/*.cpp", "src/**/*.h", "src/**/*.cu", "docs/*.md", "tests/**/*.cpp", "scripts/*"):
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    parts.append(f.read())
    return "".join(parts)


def multilingual(n, seed=5):
    rng = random.Random(seed)
    words = ("Mixture of experts routes each token to a few expert networks 专家 混合 模型 路由 "
             "エキスパート トークン 전문가 혼합 Эксперты маршрутизация 😀 🚀 café naïve 12345 3.14").split()
    return "".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 25))) + rng.choice([". ", ".\n", "\n\n"])
                   for _ in range(n))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pythonpath", default=os.path.join(ROOT, ".deps/py"))
    args = ap.parse_args()
    sys.path.insert(0, args.pythonpath)
    import tokenizers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    code = source_text()
    text = code + multilingual(20000)
    reps = int(args.mb * 1e6 / len(text.encode())) + 1
    text = (text * reps).encode()[: int(args.mb * 1e6)].decode("utf-8", errors="ignore")
    data = text.encode()
    tmp = tempfile.mkdtemp(prefix="moecore_tok_bench_")
    text_path = os.path.join(tmp, "text.txt")
    with open(text_path, "wb") as f:
        f.write(data)
    mb = len(data) / 1e6
    print(f"tokenizers {tokenizers.__version__}; text {mb:.2f} MB ({len(code) / 1e6:.2f} MB of sources and docs "
          f"+ a generated multilingual part, repeated); {os.cpu_count()} CPUs")

    def trainer():
        return trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False,
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    llama3 = Tokenizer(models.BPE(ignore_merges=True))
    llama3.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    llama3.decoder = decoders.ByteLevel()
    chunks = [text[i:i + 65536] for i in range(0, len(text), 65536)]
    for name, tok in (("gpt2", gpt2), ("llama3", llama3)):
        tok.train_from_iterator([code, multilingual(20000)], trainer())
        path = os.path.join(tmp, f"{name}.tokenizer.json")
        tok.save(path)
        ids_path = os.path.join(tmp, f"{name}.ids")
        subprocess.check_call([args.bench, path, text_path, str(args.repeats), ids_path])
        best = 1e30
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ids = tok.encode(text, add_special_tokens=False).ids
            best = min(best, time.perf_counter() - t0)
        best_batch = 1e30
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tok.encode_batch(chunks, add_special_tokens=False)
            best_batch = min(best_batch, time.perf_counter() - t0)
        print(f"tokenizers {path}: {len(ids)} ids, encode() best of {args.repeats} {mb / best:.1f} MB/s, "
              f"encode_batch(64 KB chunks) {mb / best_batch:.1f} MB/s")
        with open(ids_path, "rb") as f:
            ours = f.read()
        import array
        theirs = array.array("I", ids).tobytes()
        print(f"ids {'equal' if ours == theirs else 'DIFFER'} ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
