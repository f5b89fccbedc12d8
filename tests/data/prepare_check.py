#!/usr/bin/env python3
"""`moecore data prepare` against the Python `tokenizers` library (pinned in scripts/setup.sh,
installed into .deps/py). Trains a GPT-2 style byte-level BPE tokenizer with <|endoftext|> on
generated text, writes .jsonl, .jsonl.gz (two gzip members) and .txt inputs with varied text
(CJK, emoji, accents, whitespace runs, blank lines, extra keys), runs the command with --jobs 1
and --jobs 2 and checks: every .npy holds the library's `encode(doc).ids` + EOS for each
document in input order, the two outputs are byte-identical, summary.json has the counts, the
tokenizer's SHA-256 and the dtype; --lines splits a .txt per non-empty line; a vocabulary over
65536 gives uint32. Exit 77 (CTest: skipped) when `tokenizers` cannot be imported.
Usage: prepare_check.py --moecore BIN [--pythonpath DIR] [--keep DIR]
"""
import argparse
import gzip
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

SKIP = 77

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストです。中文文本，包括标点符号！한국어 텍스트입니다.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨",
    "Accents: café naïve résumé Ångström Øresund ß İstanbul",
    "whitespace   runs\t\ttabs  \n\n\n  newlines \r\n windows\r\nline",
    "def forward(self, x):\n    return self.w2(F.silu(self.w1(x)) * self.w3(x))\n",
    "",
    " ",
    "special inside <|endoftext|> a document",
    "JSON: {\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
]


def corpus(seed, n):
    rng = random.Random(seed)
    words = ("model expert router token layer attention gradient loss batch the of and to in is "
             "Mixture Experts 東京 数据 😀 café").split()
    out = []
    for _ in range(n):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        if rng.random() < 0.3:
            line += " " + str(rng.randint(0, 10 ** rng.randint(1, 9)))
        if rng.random() < 0.2:
            line += "\n" + rng.choice(TEXTS)
        out.append(line)
    return out


def read_npy(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x93NUMPY", f"{path}: no .npy magic"
    assert data[6:8] == b"\x01\x00", f"{path}: not version 1.0"
    (hlen,) = struct.unpack("<H", data[8:10])
    header = data[10:10 + hlen].decode("latin1")
    assert (10 + hlen) % 64 == 0, f"{path}: header of {10 + hlen} bytes is not 64-aligned"
    d = eval(header)  # a Python literal dict, as NumPy writes it
    assert d["fortran_order"] is False and len(d["shape"]) == 1, header
    width = {"<u2": 2, "<u4": 4}[d["descr"]]
    body = data[10 + hlen:]
    (n,) = d["shape"]
    assert len(body) == n * width, f"{path}: {len(body)} bytes for {n} items of {width}"
    fmt = "<%d%s" % (n, "H" if width == 2 else "I")
    return d["descr"], list(struct.unpack(fmt, body))


def run(cmd, expect_rc=0):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != expect_rc:
        raise AssertionError(f"{' '.join(cmd)}: exit {p.returncode}, expected {expect_rc}\n{p.stdout}{p.stderr}")
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moecore", required=True)
    ap.add_argument("--pythonpath")
    ap.add_argument("--keep")
    args = ap.parse_args()
    if args.pythonpath:
        sys.path.insert(0, args.pythonpath)
    try:
        import tokenizers
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        print(f"SKIPPED: the Python `tokenizers` library is not importable ({e}); run scripts/setup.sh")
        return SKIP
    print(f"tokenizers {tokenizers.__version__}")

    folder = args.keep or tempfile.mkdtemp(prefix="moecore_prepare_")
    os.makedirs(folder, exist_ok=True)

    def trained(vocab, specials, name):
        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        t.train_from_iterator(corpus(1, 3000) + TEXTS * 20, trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=specials, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        path = os.path.join(folder, name)
        t.save(path)
        return t, path

    tok, tok_path = trained(1000, ["<|padding|>", "<|endoftext|>"], "tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    assert eos == 1, eos

    # Inputs.
    docs_a = corpus(2, 3000) + TEXTS
    docs_b1, docs_b2 = corpus(3, 800), corpus(4, 700) + TEXTS
    text_c = "".join(corpus(5, 200)) + "\n".join(TEXTS)
    lines_d = [x.replace("\r", " ").replace("\n", " ") for x in corpus(6, 300)]
    a = os.path.join(folder, "a.jsonl")
    with open(a, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs_a):
            f.write(json.dumps({"id": i, "text": d, "meta": {"x": [1, 2]}}, ensure_ascii=i % 2 == 0) + "\n")
            if i % 97 == 0:
                f.write("\n   \n")  # blank lines are skipped
    b = os.path.join(folder, "b.jsonl.gz")
    with open(b, "wb") as f:  # two gzip members, as `cat x.gz y.gz` makes
        for part in (docs_b1, docs_b2):
            f.write(gzip.compress("".join(json.dumps({"text": d}) + "\r\n" for d in part).encode()))
    c = os.path.join(folder, "c.txt")
    with open(c, "w", encoding="utf-8", newline="") as f:
        f.write(text_c)
    d_path = os.path.join(folder, "lines", "d.txt")
    os.makedirs(os.path.dirname(d_path), exist_ok=True)
    with open(d_path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(lines_d) + "\n")

    def expected(documents):
        ids = []
        for doc in documents:
            ids += tok.encode(doc, add_special_tokens=False).ids + [eos]
        return ids

    want = {"a": expected(docs_a), "b": expected(docs_b1 + docs_b2), "c": expected([text_c])}
    outs = {}
    for jobs in (1, 2):
        out = os.path.join(folder, f"out{jobs}")
        p = run([args.moecore, "data", "prepare", "--tokenizer", tok_path, "--out", out, "--jobs", str(jobs), a, b, c])
        print(p.stdout.strip())
        outs[jobs] = out
        assert sorted(os.listdir(out)) == ["a.npy", "b.npy", "c.npy", "summary.json"], os.listdir(out)
        for stem, ids in want.items():
            descr, got = read_npy(os.path.join(out, stem + ".npy"))
            assert descr == "<u2", descr
            if got != ids:
                first = next(i for i in range(min(len(got), len(ids))) if got[i] != ids[i]) if got[:len(ids)] != ids[:len(got)] else min(len(got), len(ids))
                raise AssertionError(f"{stem}.npy (--jobs {jobs}): {len(got)} ids, expected {len(ids)}; first difference at {first}")
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        with open(tok_path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        assert s["tokenizer"]["sha256"] == sha, s["tokenizer"]
        assert s["dtype"] == "uint16" and s["eos_id"] == eos and s["eos_token"] == "<|endoftext|>", s
        assert s["documents"] == len(docs_a) + len(docs_b1) + len(docs_b2) + 1, s["documents"]
        assert s["tokens"] == sum(len(v) for v in want.values()), s["tokens"]
        assert [x["documents"] for x in s["sources"]] == [len(docs_a), len(docs_b1) + len(docs_b2), 1], s["sources"]
        assert [x["output"] for x in s["sources"]] == ["a.npy", "b.npy", "c.npy"], s["sources"]
    for name in sorted(os.listdir(outs[1])):
        with open(os.path.join(outs[1], name), "rb") as f1, open(os.path.join(outs[2], name), "rb") as f2:
            assert f1.read() == f2.read(), f"{name} differs between --jobs 1 and --jobs 2"
    print("ids equal the library's encode + EOS; --jobs 1 and 2 byte-identical")

    # --lines: one document per non-empty line; another EOS by id.
    out = os.path.join(folder, "out_lines")
    run([args.moecore, "data", "prepare", "--tokenizer", tok_path, "--out", out, "--lines", "--eos-id", "0", d_path])
    _, got = read_npy(os.path.join(out, "d.npy"))
    ids = []
    for line in lines_d:
        ids += tok.encode(line, add_special_tokens=False).ids + [0]
    assert got == ids, "--lines ids differ"
    print("--lines and --eos-id match")

    # A vocabulary over 65536 ids: uint32.
    big = json.load(open(tok_path, encoding="utf-8"))
    big["added_tokens"].append({"id": 70000, "content": "<|big|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    big_path = os.path.join(folder, "big.tokenizer.json")
    with open(big_path, "w", encoding="utf-8") as f:
        json.dump(big, f, ensure_ascii=False)
    out = os.path.join(folder, "out_big")
    run([args.moecore, "data", "prepare", "--tokenizer", big_path, "--out", out, c])
    descr, got = read_npy(os.path.join(out, "c.npy"))
    assert descr == "<u4" and got == want["c"], descr
    print("vocabulary over 65536: uint32")

    if not args.keep:
        shutil.rmtree(folder)
    print("data prepare matches the library")
    return 0


if __name__ == "__main__":
    sys.exit(main())
