#!/usr/bin/env python3
"""Golden test of moe::Tokenizer against the Python `tokenizers` library (pinned in
scripts/setup.sh, installed into .deps/py). Trains small byte-level BPE tokenizers on generated
text (GPT-2 style ByteLevel; ByteLevel with a prefix space and added tokens with lstrip / rstrip /
single_word / normalized, merges written in the old "a b" form; Llama 3 style Split regex +
ByteLevel(use_regex=False) with ignore_merges; NFC + ByteLevel), saves each as tokenizer.json in a
temporary folder with the ids and decoded text the library gives for varied texts, and runs the
C++ checker on each. Exit 77 (CTest: skipped) when `tokenizers` cannot be imported.
Usage: golden.py --check BIN [--pythonpath DIR] [--keep DIR]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

SKIP = 77
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

SNIPPETS = [
    "def forward(self, x):\n    return self.w2(F.silu(self.w1(x)) * self.w3(x))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say it's fine; we've done it, you'd agree.",
    "THE CAT'S HAT. DON'T! It'S oK'LL",
    "Numbers: 0 7 42 1234567890 3.14159 -273.15 1e-9 0x1F 2024-12-01 12:30:45 $1,000,000.00",
    "日本語のテキストです。中文文本，包括标点符号！한국어 텍스트입니다.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨",
    "Accents: café naïve résumé Ångström Øresund ß ǅ İstanbul",
    "Combining: cafe\u0301 n\u0303 A\u030a Hangul \u1100\u1161\u11a8",
    "Arabic: مرحبا بالعالم Hebrew: שלום עולם Greek: Καλημέρα κόσμε Cyrillic: Привет мир",
    "whitespace   runs\t\ttabs  \n\n\n  newlines \r\n windows\r\nline   \u00a0nbsp\u3000ideographic\u2003em ",
    "    leading spaces and trailing    ",
    "\n",
    "",
    " ",
    "   \n  \n",
    "a",
    "symbols: !@#$%^&*()_+-=[]{}|;':\",./<>?`~ §±¶•…—–‘’“”«»",
    "url https://example.com/path?q=1&r=two#frag and email someone@example.org",
    "JSON: {\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ababababababababab abab aab aaab",
    "Control \x00\x01\x07\x1b[0m chars \x7f\u0085 end",
    "Zero width \u200b\u200c\u200d joiners \ufeff BOM",
]


def corpus(seed, n):
    rng = random.Random(seed)
    words = ("model expert router token layer attention gradient loss batch the of and to in is "
             "Mixture Experts 東京 数据 😀 café").split()
    out = []
    for _ in range(n):
        k = rng.randint(1, 30)
        line = " ".join(rng.choice(words) for _ in range(k))
        if rng.random() < 0.3:
            line += " " + str(rng.randint(0, 10 ** rng.randint(1, 9)))
        if rng.random() < 0.2:
            line = " " * rng.randint(1, 5) + line
        out.append(line + rng.choice(["\n", "\n\n", " ", "\t", "\r\n"]))
    return out


def cases(tok, specials, added):
    texts = list(SNIPPETS)
    for s in specials:
        texts += [s, f"{s}Hello", f"text{s}more", f"{s}{s}", f" {s} spaced {s}\n", f"x {s}{SNIPPETS[5]}{s}"]
    for a in added:
        texts += [f"{a}", f"word{a}word", f"a {a} b", f"  {a}  ", f"{a}{a}", f"\t{a}\n"]
    texts.append("".join(SNIPPETS) * 3)
    texts.append("".join(corpus(99, 2000)))
    texts.append("".join(corpus(7, 50)) + "".join(specials))
    out = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False).ids
        out.append({"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", required=True)
    ap.add_argument("--pythonpath")
    ap.add_argument("--keep")
    args = ap.parse_args()
    if args.pythonpath:
        sys.path.insert(0, args.pythonpath)
    try:
        import tokenizers
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
        from tokenizers import processors, trainers
    except ImportError as e:
        print(f"SKIPPED: the Python `tokenizers` library is not importable ({e}); run scripts/setup.sh")
        return SKIP
    print(f"tokenizers {tokenizers.__version__} from {os.path.dirname(tokenizers.__file__)}")

    train = corpus(1, 3000) + SNIPPETS * 20
    built = []

    def trainer(vocab, specials):
        return trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    # GPT-2 style.
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    t.train_from_iterator(train, trainer(1200, ["<|endoftext|>"]))
    built.append(("gpt2", t, ["<|endoftext|>"], [], False))

    # ByteLevel with a prefix space; added tokens with flags; merges as "a b" strings.
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(train, trainer(800, ["<s>", "</s>"]))
    t.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=False, special=True, normalized=False),
                          AddedToken("<sep>", rstrip=True, special=True, normalized=False),
                          AddedToken("<s><s>", special=True, normalized=False)])
    t.add_tokens([AddedToken("expert", single_word=True, normalized=True),
                  AddedToken(" router", normalized=True), AddedToken("東京", normalized=True)])
    built.append(("prefix_added", t, ["<s>", "</s>", "<mask>", "<sep>"], ["expert", " router", "東京"], True))

    # Llama 3 style.
    t = Tokenizer(models.BPE(ignore_merges=True))
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(train, trainer(1500, ["<|begin_of_text|>", "<|eot_id|>"]))
    t.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                     special_tokens=[("<|begin_of_text|>", 0)])
    built.append(("llama3", t, ["<|begin_of_text|>", "<|eot_id|>"], [], False))

    # GPT-NeoX style: NFC, then ByteLevel.
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(train, trainer(1000, ["<|endoftext|>", "<|padding|>"]))
    built.append(("neox_nfc", t, ["<|endoftext|>", "<|padding|>"], [], False))

    folder = args.keep or tempfile.mkdtemp(prefix="moecore_tok_golden_")
    os.makedirs(folder, exist_ok=True)
    failed = []
    for name, tok, specials, added, string_merges in built:
        path = os.path.join(folder, f"{name}.tokenizer.json")
        tok.save(path)
        if string_merges:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
            d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]
            with open(path, "w", encoding="utf-8") as f:
                json.dump(d, f, ensure_ascii=False)
            tok = Tokenizer.from_file(path)
        with open(os.path.join(folder, f"{name}.cases.json"), "w", encoding="utf-8") as f:
            json.dump(cases(tok, specials, added), f, ensure_ascii=False)
        rc = subprocess.call([args.check, path, os.path.join(folder, f"{name}.cases.json")])
        if rc != 0:
            failed.append(name)
    print(f"files in {folder}")
    if failed:
        print("FAILED:", " ".join(failed))
        return 1
    print("all tokenizers match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
